"""Chapter 4, ZeRO-3 (P_os+g+p): partition the parameters too (paper Sec 5.3, Sec 7.2.2).

* notebook: ``notebooks/src/04_zero3.py``, built into ``notebooks/04_zero3.ipynb`` and
  the reader's copy ``notebooks/exercises/04_zero3.ipynb``;
* lesson: :mod:`.lesson`, the runs the chapter and chapter 6 reuse (``all_stages``,
  ``simulate``);
* exercise ``04.gather_hooks`` (:mod:`.gather_hooks`, checked by
  :mod:`.gather_hooks_check`): module and gradient hooks that all-gather a unit's
  parameters before its forward and again before its backward, and free them after each;
* exercise ``04.prefetch`` (:mod:`.prefetch`, checked by :mod:`.prefetch_check`): while
  one unit computes, the next unit's all-gather is in flight, in forward (the unit after)
  and in backward (the unit before);
* exercise ``04.nano_engine`` (:mod:`.nano_engine`, checked by :mod:`.nano_engine_check`):
  the reader's functions of chapters 1-4 assembled into :class:`zerolearn.nano.NanoZero`,
  trained at stages 0-3 against one process, with Fig 1's bytes and 2 / 2 / 2 / 3 Psi per
  step; a wrong part is named with its own exercise's words;
* the file to take home: :mod:`.take_home` writes the reader's functions into
  :mod:`.my_zero`, one standalone torch script (DP and ZeRO-1/2/3 by ``--stage``) that the
  chapter runs under torchrun and that checks itself against one process and Fig 1's bytes;
* exercise ``04.main`` (``my_zero.main``, checked by :mod:`.main_check`): that script's
  program, the process group, the model and the training loop, run under torchrun on 2
  and 3 ranks and once with a wrong part, where it must exit with status 1.

The trials cut the book's MLP (4 Linear layers of width 64, 4,160 parameters each, fp32)
into one unit per layer, laid out as the engine lays them
(:func:`zerolearn.exercises.helpers.sharded_units`): each unit's parameters are views of
a flat buffer whose storage is resized to 0 bytes between uses, and each rank keeps its
shard. ``04.gather_hooks`` trains three SGD steps against one process under the memory
ledger; ``04.prefetch`` runs evaluation and training passes and logs the order of
launches, waits and computes; ``04.nano_engine`` trains the MLP with Adam.
"""
