"""CPU double of NVIDIA transformer-engine (tests only; see tests/doubles/README.md).

Read from transformer-engine's source at v2.9 and v2.14 (and checked against v2.18): the constructor, device and
init semantics of `transformer_engine.pytorch.Linear` (module/linear.py, module/base.py), `autocast` and
`FP8GlobalStateManager` (quantization.py), `distributed.checkpoint` (distributed.py), the recipe classes
(common/recipe/__init__.py), and the FP8 shape rule of utils.assert_dim_for_fp8_exec.

What differs from the real library: it runs on the CPU, simulates a device that supports every FP8 recipe, and
simulates FP8 GEMMs by rounding the input and the weight through float8_e4m3fn with per-tensor current scaling
(straight-through in backward); each Linear counts the forwards it ran inside and outside autocast. Where TE
computes on silently against its documented contract, the double refuses: a backward inside an enabled te.autocast
region (pytorch/quantization.py's doc says what TE does then).
"""

__version__ = "2.9.0"
