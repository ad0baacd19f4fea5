"""Fused CPU kernels of the quantized decode path, in plain C (fp32), compiled on first use.

They replace the torch ops between a decode step's matmuls; one line per kernel, and its user:

* :func:`rms_norm` - rows of ``[T, H, D]`` (any row strides) times a per-head multiplier: the RMSNorm layers;
* :func:`rope_rotate_half` - RoPE of q and k heads in one pass, bit for bit the torch ops': the rotary embedding;
* :func:`gated_act` - ``act(gate) * up`` (silu, gelu-tanh, :data:`ACTIVATIONS`) in one pass: the gated MLP;
* :func:`decode_attention` - one query per sequence, its K/V written, then read through the block table
  (an fp32, bf16 or fp16 cache, :data:`KV_TYPES`): the ``"cpu"`` attention backend;
* :func:`q8_linear`, :func:`q4_linear` - fp32 rows times an int8 / int4 weight, split over the kernels' threads:
  the weight-only quantized linear layers;
* :func:`gguf_linear`, :func:`gguf_rows` - fp32 rows times a weight in a GGUF file's blocks, and its rows
  dequantized: a GGUF checkpoint run as it is stored (``--quantization auto``);
* ``decode_stack`` (on the module :func:`load` returns) - all decoder layers of a decode step in one call,
  from a plan of pointers: the fused decode step;
* :func:`hold_cores` - whether the kernels' threads or torch's hold the cores: the model's forward (each
  step) and the engine (torch's again when idle).

:func:`load` gives the compiled module (None where it cannot be built) and :func:`unavailable`
why not; the attention backend choice and the models' ``use_cpu_kernels`` ask them. The build,
its cache and ``HYBRIDKV_CPU_OPS`` are described in :mod:`hybridkv.engine.cpu_ops.build`, the
wrappers' shapes in :mod:`hybridkv.engine.cpu_ops.bindings`. The results differ from torch's by
float rounding (except RoPE): the engine uses them only on its fast paths (weight-only
quantization), never on the exact fp32 default.
"""

from __future__ import annotations

from hybridkv.engine.cpu_ops.bindings import (ACTIVATIONS, KV_TYPES, decode_attention, gated_act, gguf_linear,
                                              gguf_rows, hold_cores, q4_linear, q8_linear, rms_norm, rope_rotate_half, rounded_rows, rounding_block)
from hybridkv.engine.cpu_ops.build import (FLAGS, HERE, MODULE, PRUNE_AFTER_DAYS, SOURCES, load, unavailable)
# private names the tests reach through the package (``_state``: the same dict the build and hold_cores write)
from hybridkv.engine.cpu_ops.build import _build, _compiler, _prune, _state  # noqa: F401

__all__ = ["KV_TYPES", "decode_attention", "gated_act", "gguf_linear", "gguf_rows", "hold_cores", "load", "q4_linear", "q8_linear", "rms_norm",
           "rope_rotate_half", "rounded_rows", "rounding_block", "unavailable"]
