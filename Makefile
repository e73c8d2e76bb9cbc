# make tour   train the small GPT under DP, ZeRO-1, ZeRO-2, ZeRO-3 on 4 ranks; print the table
# make test   run the test suite, then the chapter notebooks under strict nbval
# make check  the quick loop: unit tests, world-size-2 equivalence, one short notebook
# make notebooks  re-execute every chapter from notebooks/src/ and store its outputs
# make book   build the book from the stored notebooks (book/_build/html)
# make timeline  record one step per stage on every rank (torch.profiler) for chapters 01-04
# make bench  our stages against DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed at d_model 128 and 384, the overhead against DDP at world size 1, then the scaling sweeps (QUICK=1: the comparison only, about 2 min; GPU=1: on every GPU at d_model 1024 against torch's systems)
# The first use creates .venv with a pinned torch (override: make TORCH=torch==2.11.0 ...).
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: tour test check notebooks book lint clean gpu-check deepspeed paper-map bench timeline

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

tour: $(VENV)/.installed
	$(PY) -m zerolearn.tour

# The tests; the chapters under strict nbval, with NBVAL_ENV's variables set (CI's make the
# CPU compute as an older one does: .ci/run); beside it, the reader's copies
# (notebooks/exercises/, no stored outputs) must run top to bottom without an error, every
# exercise saying "not written yet". The two notebook passes run side by side (the strict
# one runs its kernels on one thread under CI's NBVAL_ENV); the readers' log follows. In both,
# a FutureWarning (a deprecated torch call, say) is an error, in the kernels and their ranks.
NBVAL_ENV ?=
test: $(VENV)/.installed
	$(PY) -m pytest tests
	@log=$$(mktemp); \
	PYTHONWARNINGS=error::FutureWarning $(PY) -m pytest --nbval-lax notebooks/exercises -p no:cacheprovider > $$log 2>&1 & readers=$$!; \
	PYTHONWARNINGS=error::FutureWarning $(NBVAL_ENV) $(PY) -m pytest --nbval notebooks -p no:cacheprovider --ignore=notebooks/exercises; strict=$$?; \
	wait $$readers; lax=$$?; \
	echo "--- the reader's copies (notebooks/exercises/, nbval-lax) ---"; cat $$log; rm -f $$log; \
	[ $$strict -eq 0 ] && [ $$lax -eq 0 ]

# A few minutes on 2 cores: everything not marked slow or browser (each tests/test_*.py
# states its tier in its pytestmark; tests/conftest.py adds slow at world size > 2)
# and the shortest chapter under nbval.
check: $(VENV)/.installed
	$(PY) -m pytest tests -m "not slow and not browser" -q
	$(PY) -m pytest --nbval notebooks/00_memory_wall.ipynb -p no:cacheprovider -q

# NB=02_zero1 rebuilds one chapter; chapters that read another's results are rebuilt in order.
notebooks: $(VENV)/.installed
	$(PY) notebooks/build.py $(NB)

book: $(VENV)/.installed
	rm -f book/_build/html/.built-with-W
	$(VENV)/bin/jupyter-book build . --config book/_config.yml --toc book/_toc.yml --path-output book -W --keep-going
	touch book/_build/html/.built-with-W   # the browser tests use this build while it is newer than its sources

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check zerolearn tests notebooks

# DeepSpeed's own stages 0-3 on CPU (2 gloo ranks), stored for chapter 7.
deepspeed: $(VENV)/.installed
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet --no-build-isolation deepspeed
	rm -f notebooks/data/deepspeed_cpu.json
	for stage in 0 1 2 3; do \
		DS_ACCELERATOR=cpu $(VENV)/bin/torchrun --standalone --nproc-per-node=2 \
			-m zerolearn.experiments.deepspeed_cpu --stage $$stage --out notebooks/data/deepspeed_cpu.json || exit 1; \
	done

# Results go to notebooks/data/bench/ (QUICK=1: quick.json; else bench.json and scaling.json, chapter 7's figure).
# DeepSpeed is installed without compiled ops; if that fails the bench runs without it.
# GPU=1: the comparison on the GPUs instead (NCCL, one rank per GPU, every GPU of the machine),
# a GPT of d_model 1024, 8 layers, 16 heads, 256 tokens, batch 16, against torch's systems:
# notebooks/data/bench/gpu.json, which chapter 7 shows beside the CPU table.
GPU_BENCH := --device cuda --width 1024 --layers 8 --heads 16 --seq-len 256 --batch 16 --rounds 3 --warmup 2 \
	--steps 10 --systems zerolearn,torch --out notebooks/data/bench/gpu.json
bench: $(VENV)/.installed
	mkdir -p notebooks/data/bench
ifdef GPU
	$(PY) -m zerolearn.bench $(GPU_BENCH) --world-size $$($(PY) -c "import torch; print(max(1, torch.cuda.device_count()))")
else
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet --no-build-isolation deepspeed || echo "deepspeed could not be installed: benchmarking without it"
	$(PY) -m zerolearn.bench $(if $(QUICK),--quick,--widths 128,384 --overhead) --out notebooks/data/bench/$(if $(QUICK),quick,bench).json
	$(if $(QUICK),,$(PY) -m zerolearn.bench scaling --out notebooks/data/bench/scaling.json)
endif

# notebooks/data/timeline/: what chapters 01-04 draw (about 1 min; TRACES=DIR also writes Chrome traces).
timeline: $(VENV)/.installed
	$(PY) -m zerolearn.timeline --out notebooks/data/timeline/ $(if $(TRACES),--traces $(TRACES))

# book/paper_map.md is generated from zerolearn/papermap.py; tests/test_papermap.py checks it is current.
paper-map: $(VENV)/.installed
	$(PY) -m zerolearn.papermap > book/paper_map.md

gpu-check: $(VENV)/.installed
	$(PY) -m zerolearn.gpu_check

clean:
	rm -rf $(VENV) .pytest_cache
