"""The GPU tests (``pytest -m gpu tests/gpu``): the former scripts/h200_* checks, each
case a parametrized test and each check a plain ``assert``, every test marked ``gpu`` and
skipped ("no CUDA device") on a machine without CUDA. ``tests/gpu/run_h200.sh`` builds the
library and runs them all on an H200. A package, so that its modules' names
(``gpu.test_gemv``) do not clash with the CPU suite's (``test_gemv``)."""
