"""What each test tier may expect of the numbers, stated once.

Exactness tests (parity with HF / PEFT / numpy, tp = one device, restart identity, memory-plan
arithmetic) pin ``EXACT``: float32 compute, which `dtype="auto"` is not on every machine (bf16
on CPUs with bf16 units and on GPUs). Their tolerances below hold for float32 on any platform:
the engine traces float32 models at full float32 precision (models/tracing.py), and the
session's own jnp references do too (conftest sets jax's default matmul precision).

The bf16 tier pins ``BF16`` and checks what bf16 promises against the float32 model: top-1
agreement and bounded logit error, bounds that hold on any machine.
"""

from __future__ import annotations

EXACT = {"dtype": "float32"}
BF16 = {"dtype": "bfloat16"}

# float32 logits against HF transformers (torch, CPU, float32): tiny random models, and the
# default SmolLM2 (30 layers: error grows with depth).
LOGITS_TOL_TINY = 1e-4
LOGITS_TOL_DEFAULT = 2e-3

# Attention kernels against the naive jnp attention on random ragged batches: float32 inputs
# (the kernels' f32 dots are HIGHEST, and so are the references': conftest), and bf16 inputs
# against the reference on the same bf16-rounded inputs. The same bounds on CPU and GPU.
KERNEL_ATOL_F32 = 1e-5
KERNEL_ATOL_BF16 = 2e-2

# bf16 against the same model in float32, teacher-forced on the parity prompts.
BF16_MIN_TOP1 = 0.95            # share of positions whose argmax agrees
BF16_MAX_LOGIT_ERR = 0.25       # max |logit diff| relative to the float32 logits' spread (std)

# The CPU kind the session runs as (`pytest --matrix-units`; conftest sets it, and
# $JAXSERVE_MATRIX_UNITS for every engine and process the tests start).
FORCED_KIND = "auto"
