"""The GPU kit: in one command, the checks of the engine that only a CUDA device can make.

    python tools/gpu_kit [--out gpu-report.json] [--sections plugin,parity,delayed,...]
    nox -s gpu            (the same with the machine's own python and torch; never run by CI)

It needs nothing but torch (2.11 or newer) and this checkout: the four packages are imported
from ``packages/*/src`` and the mutation list from ``tests/``, so a machine without a package
index runs it as it is (``llama`` also uses transformers when it is there). Each section runs
in a subprocess of its own (the threaded process group and CUDA's sanitizer change the process
they run in) and the report is one JSON file:

* ``parity``: world size 1 on NCCL, shardweave against torch's ``fully_shard`` on the same
  model and batches (per-block FSDP, CPU batches, bf16 compute with fp32 reduction, CPU
  offload with optimizer-in-backward hooks and the full state dict, ``replicate``, HSDP on a
  1x1 mesh): losses, shards and grads bitwise.
* ``plugin``: the test plugin of ``delayed`` checked on its own: its all-gather, reduce-scatter
  (sum, average) and all-reduce at four ranks against closed forms, with the delay.
* ``delayed``: four ranks on the one GPU as threads of one process, through a test
  ``COLLECTIVES`` plugin (``DelayedCollectives``) that moves the right bytes on the stream the
  engine issues on, after an injected ``torch.cuda._sleep`` (a late producer), and with a
  sleep on the current stream before each consumer (``DELAY_POINTS``: the copy-out, the
  copy-in, the reduce-scatter input's layout, the optimizer step). What a delayed writer
  writes is filled with NaN first (the collectives' outputs, the copy-in's slot, the layout's
  output), and each run's buffers sit at other addresses than the previous run's (a spacer),
  so a read that does not wait sees garbage, not the same values a replay left there. Cases:
  FSDP, bf16, HSDP 2x2 with fp32 and bf16 reductions, ``replicate`` with both, CPU offload
  (non-blocking and with optimizer-in-backward hooks). Each must be bitwise equal to the same
  run with no delay and a device synchronization after every collective.
* ``mutants``: the tests' own mutations (``WAIT_MUTATIONS`` and ``KEEP_ALIVE_MUTATIONS`` of
  ``tests/fsdp/_stream_order.py``: every stream wait and keep-alive of the engine's design
  note), one at a time. On CUDA the mutant's waits are removed from ``torch.cuda.Stream``
  and the run, delayed at that mutant's producer only (``MUTANT_DELAYS``: a sleep elsewhere
  can delay the waiter as much and hide the race) and poisoned, must differ from the
  synchronized one (while the control, the same run unmutated, agrees); on CPU each runs at
  two gloo ranks on the test accelerator and the stream sanitizer must report it. Every
  mutant must be caught.
* ``llama``: a transformers ``LlamaForCausalLM`` (tied and untied embeddings, bf16 and fp32,
  with and without CPU offload) at world 1, with torch's engine run twice as the control:
  a difference is reported only where torch's engine agrees with itself.
* ``sync``: ``torch.cuda.set_sync_debug_mode("warn")`` over steady-state steps: every host
  synchronization (torch's sync warnings only; other warnings are listed apart) of our
  engine and of torch's FSDP2 in the same loop; passes iff ours makes no more.
* ``csan``: a few steps under ``TORCH_CUDA_SANITIZER=1`` (torch's CUDA stream sanitizer).
* ``bench``: step time and per-phase allocated/peak memory (after forward, backward, the
  optimizer step, between steps) against torch's FSDP2 at world size 1, on a model of about
  0.54 B parameters with bf16 compute; each of the four rounds in a fresh process, and the
  section fails unless every round starts from the same allocated bytes.

Without a CUDA device (or without torch) it says so in one line and exits 0. ``--device cpu``
runs every section that does not need CUDA on the CPU (``delayed`` without the sleeps,
``parity`` and ``llama`` on gloo, ``mutants`` under the sanitizer, ``bench`` at a tiny size
with live tensor bytes): the test suite proves the kit's own logic that way
(``tests/tools/test_gpu_kit.py``).

One module per section (``parity.py``, ``plugin.py``, ``delayed.py``, ``mutants.py``,
``llama.py``, ``sync.py``, ``csan.py``, ``bench.py``), what several share in ``_common.py``
(paths, the world-1 and threaded process groups) and ``_training.py`` (the model, the engines,
the training loop and the bitwise comparison), the command line in ``driver.py``. No module
imports torch at import time: the driver must answer "no torch" in a python without it.
"""
