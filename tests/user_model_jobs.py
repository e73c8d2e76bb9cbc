"""Models nobody here wrote, and loops written the way their users write them, for
spawned gloo ranks: Hugging Face GPT-2 (tied and untied), Llama, BERT, T5, ViT, ALBERT,
Qwen2 (tied), BART tiny configs and torch's nn.Transformer, a BatchNorm CNN,
hand-written weight tying, parents that read their children's weights, units that
return dataclasses, branches unused on some or all ranks, mixed-dtype parameters."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from zerolearn import checkpoint, comm, data
from zerolearn import dist as zdist
from zerolearn.engines import make_engine

BATCH, SEQ, VOCAB = 12, 16, 256


HF_KINDS = ("bert", "t5", "vit", "albert", "qwen2_tied", "bart", "torch_transformer")
SEQ2SEQ = ("t5", "bart", "torch_transformer", "switch")


def hf_model(kind: str) -> nn.Module:
    """A tiny Hugging Face model built from a config in code (nothing downloaded)."""
    import transformers

    torch.manual_seed(0)
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if kind == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=VOCAB, max_position_embeddings=SEQ,
                                                                    **small, **no_dropout))
    if kind == "albert":
        return transformers.AlbertForMaskedLM(transformers.AlbertConfig(
            vocab_size=VOCAB, embedding_size=16, max_position_embeddings=SEQ, **small, **no_dropout))
    if kind == "vit":
        return transformers.ViTForImageClassification(transformers.ViTConfig(
            image_size=8, patch_size=4, num_channels=3, num_labels=10, **small, **no_dropout))
    if kind == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0))
    if kind == "bart":
        return transformers.BartForConditionalGeneration(transformers.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=SEQ,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))
    if kind == "qwen2_tied":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=True))
    moe = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=SEQ)
    if kind == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=8, num_experts_per_tok=2,
                                                                          **moe))
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            decoder_sparse_step=1, **moe))
    if kind == "switch":  # capacity 2 per expert and sequence: tokens dropped, experts idle on some ranks
        return transformers.SwitchTransformersForConditionalGeneration(transformers.SwitchTransformersConfig(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            num_experts=8, expert_capacity=2, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
            dropout_rate=0.0, router_jitter_noise=0.0, decoder_start_token_id=0, pad_token_id=0))
    if kind in ("gpt2", "gpt2_untied"):
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                      tie_word_embeddings=kind == "gpt2", attn_pdrop=0.0, embd_pdrop=0.0,
                                      resid_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(cfg)


class HandTied(nn.Module):
    """Ties the head to the embedding by reading ``emb.weight`` in its own forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix = nn.Embedding(VOCAB, 16), nn.Linear(16, 16)

    def forward(self, x):
        return F.linear(torch.tanh(self.mix(self.emb(x))), self.emb.weight)


class TorchTransformer(nn.Module):
    """torch's own ``nn.Transformer`` between a token embedding and a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 32)
        self.transformer = nn.Transformer(32, 2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64,
                                          dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x, decoder_input_ids):
        return self.head(self.transformer(self.emb(x), self.emb(decoder_input_ids)))


class ReadsNextWeight(nn.Module):
    """The parent reads the next unit's weight between two units (ZeRO-3 has only
    prefetched it there)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.a, self.b = nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.Linear(16, VOCAB)

    def forward(self, x):
        h = torch.tanh(self.a(self.emb(x)))
        return self.b(h * self.b.weight.mean())


class ReadsChildWeight(nn.Module):
    """The parent uses a child's weight through ``torch.matmul`` and adds its bias."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix = nn.Embedding(VOCAB, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x):
        h = self.mix(self.emb(x))
        return self.head(torch.tanh(torch.matmul(h, self.mix.weight.t()) + self.mix.bias))


class ReadsChildBias(nn.Module):
    """The parent adds a child's bias after the child's forward has returned."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.Linear(16, VOCAB)

    def forward(self, x):
        return self.head(torch.tanh(self.mix(self.emb(x)) + self.mix.bias))


@dataclasses.dataclass
class BlockOut:
    hidden: torch.Tensor


class DataclassBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, h):
        return BlockOut(torch.tanh(self.fc(h)))


class DataclassUnits(nn.Module):
    """Units that return a dataclass (no tensor the engine can see)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList([DataclassBlock() for _ in range(3)])
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h).hidden
        return self.head(h)


class EncoderOnly(nn.Module):
    """``nn.TransformerEncoder`` as the whole model (its layers are an ``nn.ModuleList``),
    fed embeddings made outside it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)

    def forward(self, x):
        return self.encoder(x)


class Branchy(nn.Module):
    """A branch that runs only when ``use_branch`` is set (by the loop, per step and rank)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.trunk, self.branch = nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)
        self.use_branch = True

    def forward(self, x):
        h = torch.tanh(self.trunk(self.emb(x)))
        if self.use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


class BranchDiscarded(Branchy):
    """Runs the branch on every rank but adds its output only when ``use_branch``."""

    def forward(self, x):
        h = torch.tanh(self.trunk(self.emb(x)))
        b = torch.tanh(self.branch(h))
        return self.head(h + b if self.use_branch else h)


class BranchTimesZero(Branchy):
    """Adds its branch times zero when ``use_branch`` is set: the branch is used (its
    gradient is defined) and its gradient is exactly zero, on every rank that runs it."""

    def forward(self, x):
        h = torch.tanh(self.trunk(self.emb(x)))
        return self.head(h + 0.0 * torch.tanh(self.branch(h)) if self.use_branch else h)


class ExtraLast(Branchy):
    """Runs one more unit after the head when ``use_branch`` is set: a rank without it
    ends its forward while another still runs a unit."""

    def forward(self, x):
        out = self.head(torch.tanh(self.trunk(self.emb(x))))
        return out + self.branch(out[..., :16]).sum() * 0.1 if self.use_branch else out


class Reordered(nn.Module):
    """Registers its modules in another order than its forward runs them (head first)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head, self.trunk, self.emb = nn.Linear(16, VOCAB), nn.Linear(16, 16), nn.Embedding(VOCAB, 16)

    def forward(self, x):
        return self.head(torch.tanh(self.trunk(self.emb(x))))


class Nested(nn.Module):
    """A unit that calls another unit inside its own forward (``inner`` is not its child)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.inner, self.outer = nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)
        self.outer.register_forward_hook(lambda m, a, out: out + torch.tanh(self.inner(out)))

    def forward(self, x):
        return self.head(self.outer(self.emb(x)))


class MixedDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)
        self.scale = nn.Parameter(torch.ones(16, dtype=torch.float64))
        self.shift = nn.Parameter(torch.zeros(16, dtype=torch.bfloat16))

    def forward(self, x):
        return self.head(self.emb(x) * self.scale.float() + self.shift.float())


class TopKExperts(nn.Module):
    """A mixture-of-experts feed-forward layer written by hand: a router sends each token to
    its ``k`` best of ``experts`` small MLPs; an expert no token chose is not called, so its
    parameters get no gradient on that rank (``idle`` counts such calls)."""

    def __init__(self, d: int, experts: int, k: int):
        super().__init__()
        self.k, self.idle = k, 0
        self.router = nn.Linear(d, experts)
        with torch.no_grad():  # the last two experts are rarely chosen: idle on some ranks, not others
            self.router.bias.copy_(torch.tensor([0.0] * (experts - 2) + [-0.6, -0.8]))
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))
                                     for _ in range(experts))

    def forward(self, h):
        flat = h.reshape(-1, h.shape[-1])
        weights, chosen = torch.softmax(self.router(flat), dim=-1).topk(self.k, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                self.idle += 1
                continue
            out = out.index_add(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        return out.view_as(h)


class MoEBlock(nn.Module):
    def __init__(self, d: int, experts: int, k: int):
        super().__init__()
        self.norm, self.moe = nn.LayerNorm(d), TopKExperts(d, experts, k)

    def forward(self, h):
        return h + self.moe(self.norm(h))


class HandMoE(nn.Module):
    """Two mixture-of-experts blocks between an embedding and a head (blocks as ZeRO-3 units)."""

    def __init__(self, k: int):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(MoEBlock(16, 8, k) for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    @property
    def idle(self) -> int:
        return sum(block.moe.idle for block in self.blocks)


class BatchNormCNN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


HAND_WRITTEN = {"cnn": lambda: BatchNormCNN(), "hand_tied": lambda: HandTied(),
                "torch_transformer": lambda: TorchTransformer(), "reads_next": lambda: ReadsNextWeight(),
                "reads_child": lambda: ReadsChildWeight(), "reads_child_bias": lambda: ReadsChildBias(),
                "dataclass_units": lambda: DataclassUnits(),
                "encoder_only": lambda: EncoderOnly(), "branchy": lambda: Branchy(),
                "branch_discarded": lambda: BranchDiscarded(), "branch_times_zero": lambda: BranchTimesZero(),
                "extra_last": lambda: ExtraLast(),
                "reordered": lambda: Reordered(), "nested": lambda: Nested(),
                "mixed_dtypes": lambda: MixedDtypes(), "moe_top1": lambda: HandMoE(1),
                "moe_top2": lambda: HandMoE(2)}


def build(kind: str) -> nn.Module:
    return HAND_WRITTEN[kind]() if kind in HAND_WRITTEN else hf_model(kind)


def use_branch(kind: str, step: int, rank: int, branch: str | None) -> bool:
    """Whether ``Branchy`` takes its branch: ``"never"``, ``"odd_steps"`` (on every rank
    at odd steps), ``"rank0"`` (on rank 0 only), ``"rank0_at_2"`` (on rank 0 at step 2
    only), else always."""
    return {"never": False, "odd_steps": step % 2 == 1, "rank0": rank == 0,
            "rank0_at_2": rank == 0 and step == 2}.get(branch, True)


def run_model(kind: str, fn, x):
    """``fn`` (a model or an engine) on the inputs ``x``, as its kind is called."""
    return fn(x, decoder_input_ids=x) if kind in SEQ2SEQ else fn(x)


def batch(kind: str, step: int):
    g = torch.Generator().manual_seed(100 + step)
    if kind in ("cnn", "vit"):
        return torch.randn(BATCH, 3, 8, 8, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    if kind == "encoder_only":
        x = torch.randn(BATCH, SEQ, 16, generator=g)
        return x, x.roll(-1, dims=1)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, x.roll(-1, dims=1)


def loss_of(kind: str, model: nn.Module, out, y):
    logits = out.logits if hasattr(out, "logits") else out
    if kind == "encoder_only":
        return F.mse_loss(logits.float(), y)
    return F.cross_entropy(logits.float().flatten(0, -2) if kind not in ("cnn", "vit") else logits.float(),
                           y.flatten())


def torch_optimizer(name: str, params, lr: float, momentum: float, weight_decay: float):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    return {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name](params, lr=lr, weight_decay=weight_decay)


def train(kind: str, stage: int | None, steps: int = 3, accum: int = 1, accum_style: str = "repeated",
          optimizer: str = "adam", lr: float = 1e-2, momentum: float = 0.0, weight_decay: float = 0.0,
          branch: str | None = None, no_grad_first: bool = False, units: list[str] | None = None,
          resume_at: int | None = None, checkpoint_dir: str | None = None, bucket_mb: float = 0.01,
          fuse: bool = True) -> dict:
    """``stage`` None: plain PyTorch on the whole batch in one process (the reference).
    Else the engine on this rank's slice. Returns losses, full fp32 parameters, buffers.

    ``branch``: when ``Branchy`` takes its branch (:func:`use_branch`; the reference
    takes it when rank 0 would). ``no_grad_first``: run one forward under
    ``torch.no_grad()`` before training (evaluation first). ``units``: ZeRO-3 units
    by module name. ``resume_at``: after that many steps, save a checkpoint under
    ``checkpoint_dir``, then go on with a new model and engine loaded from it.
    ``fuse=False``: ZeRO-3 prefetches one unit at a time, however small (``prefetch_mb=0``;
    by default these small models' units come several to one all_gather)."""
    model = build(kind)
    if stage is None:
        opt = torch_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad], lr, momentum,
                              weight_decay)
        losses = []
        for step in range(steps):
            x, y = batch(kind, step)
            model.use_branch = use_branch(kind, step, 0, branch)
            opt.zero_grad()
            loss = loss_of(kind, model, run_model(kind, model, x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "buffers": {n: b.clone() for n, b in model.named_buffers()}}
    ctx = zdist.context()

    def new_engine(model):
        extra = {"units": [model.get_submodule(name) for name in units]} if units is not None else {}
        if stage == 3 and not fuse:
            extra["prefetch_mb"] = 0
        return make_engine(stage, model, optimizer=optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay,
                           bucket_mb=bucket_mb, **extra)

    engine = new_engine(model)
    gathers = comm.LEDGER.ops["all_gather"].calls, comm.LEDGER.ops["all_gather"].elements
    if no_grad_first:
        with torch.no_grad():
            run_model(kind, engine, data.rank_slice(batch(kind, 0)[0], ctx.rank, ctx.world_size))
    losses, uneven = [], 0
    for step in range(steps):
        if step == resume_at:
            checkpoint.save(engine, checkpoint_dir, step)
            model = build(kind)
            engine = new_engine(model)
            assert checkpoint.load(engine, checkpoint_dir) == step
        x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in batch(kind, step))
        model.use_branch = use_branch(kind, step, ctx.rank, branch)
        local = 0.0
        for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum), strict=True)):
            loss = loss_of(kind, model, run_model(kind, engine, xm), ym) / accum
            if accum_style == "no_sync" and i < accum - 1:
                with engine.no_sync():
                    engine.backward(loss)
            else:
                engine.backward(loss)
            uneven += getattr(engine, "zeros_counted", 0) > 0  # ZeRO-3: a reached unit's parameter got no gradient here
            local += loss.item()
        engine.step()
        engine.zero_grad()
        losses.append(comm.monitor_mean(local))
    if engine.broadcast_buffers:
        model.eval()  # a last forward syncs buffers, as the next step would (eval: no update after)
        run_model(kind, engine, x[:1])
    out = {"losses": losses, "params": engine.full_state_dict(),
           "buffers": {n: b.clone() for n, b in model.named_buffers()}, "uneven": uneven}
    if stage == 3:  # the units in the order the last forward ran them (ZeRO-3's prefetch schedule)
        trace = engine.schedule.trace
        out["schedule"] = None if trace is None else [engine.schedule.by_index[i].name for i in trace if i >= 0]
        # all_gather calls and elements of the whole run
        out["all_gather"] = [now - then for now, then in zip((comm.LEDGER.ops["all_gather"].calls,
                                                              comm.LEDGER.ops["all_gather"].elements), gathers,
                                                             strict=True)]
    return out


def proposals_per_forward(steps: int = 3, debug: bool = False) -> list[int]:
    """ZeRO-3 on the small GPT: how many agreement exchanges (:func:`guard.propose`) each
    step makes, without and with debug mode (``debug``)."""
    from zerolearn import guard
    from zerolearn.models import GPTConfig, build_model

    model = build_model("gpt", gpt=GPTConfig(d_model=32, n_layer=3, n_head=2, seq_len=16))
    engine = make_engine(3, model, optimizer="adam", lr=1e-3)
    ctx, counts, propose = zdist.context(), [], guard.propose

    def counted(*args, **kwargs):
        counts[-1] += 1
        return propose(*args, **kwargs)

    guard.propose = counted
    comm.set_debug(debug)
    try:
        for step in range(steps):
            x = data.rank_slice(torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(step)),
                                ctx.rank, ctx.world_size)
            counts.append(0)
            logits = engine(x)
            engine.backward(F.cross_entropy(logits.flatten(0, 1), x.roll(-1, 1).flatten()))
            engine.step()
            engine.zero_grad()
    finally:
        guard.propose = propose
        comm.set_debug(False)
    return counts


def used_flag_exchanges(stage: int, kind: str, branch: str | None = None, steps: int = 3) -> int:
    """How many exchanges of used-parameter flags (:func:`comm.monitor_max`) a :func:`train`
    run of ``steps`` steps makes on this rank."""
    calls, monitor_max = [], comm.monitor_max

    def counted(*args, **kwargs):
        calls.append(1)
        return monitor_max(*args, **kwargs)

    comm.monitor_max = counted
    try:
        train(kind, stage, steps=steps, branch=branch)
    finally:
        comm.monitor_max = monitor_max
    return len(calls)


def train_ddp(kind: str, stage: None = None, steps: int = 3, optimizer: str = "adam", lr: float = 1e-2,
              momentum: float = 0.0, weight_decay: float = 0.0, branch: str | None = None) -> dict:
    """torch's DistributedDataParallel (buffers broadcast from rank 0, its default;
    ``find_unused_parameters=True``) on this rank's slice: the reference for models
    whose forward depends on the rank (BatchNorm's local batch statistics, a branch
    taken on some ranks only)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = zdist.context()
    model = build(kind)
    ddp = DDP(model, find_unused_parameters=True)
    opt = torch_optimizer(optimizer, model.parameters(), lr, momentum, weight_decay)
    losses = []
    for step in range(steps):
        x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in batch(kind, step))
        model.use_branch = use_branch(kind, step, ctx.rank, branch)
        opt.zero_grad()
        loss = loss_of(kind, model, ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(comm.monitor_mean(loss.item()))
    model.eval()  # DDP broadcasts buffers at the start of a forward: sync them once more
    ddp(x[:1])
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buffers": {n: b.clone() for n, b in model.named_buffers()}}


def rel_error(params: dict, ref: dict) -> float:
    """Relative L2 error of ``params`` against ``ref`` over the parameters both hold."""
    diff = torch.cat([(params[n].float() - ref[n]).flatten() for n in ref if n in params])
    return (diff.norm() / torch.cat([r.flatten() for r in ref.values()]).norm()).item()


def many(runs: list[dict]) -> list[dict | str]:
    """Several :func:`train` runs in one process group; an exception becomes its message."""
    out = []
    for kw in runs:
        debug = kw.pop("debug", False)  # the ranks' agreement checks (ZEROLEARN_DEBUG_COLLECTIVES)
        comm.set_debug(debug)
        try:
            job = train_ddp if kw.pop("ddp", False) else used_flag_exchanges if kw.pop("count", False) else train
            out.append(job(**kw))
        except Exception as e:  # noqa: BLE001  (the test reads the message)
            out.append(f"{type(e).__name__}: {e}")
        finally:
            comm.set_debug(False)
    return out
