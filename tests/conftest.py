"""Suite-wide XLA:CPU settings.

Nearly all of a launch's time is XLA:CPU compiling step graphs, and nearly all of that is
LLVM optimising their machine code: 4 to 24 s a graph on this 2-core machine, under 1 s
without. Every comparison in the suite is between runs compiled with the same flags, and
what the tests read from XLA (collectives, barriers, aliasing in the traced HLO) comes
before code generation, so the suite compiles unoptimised code. A test that reads XLA's
optimised module sets its own ``XLA_FLAGS`` (``tests/fsdp/test_donation_order.py``).
"""
import os

FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                "--xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_parallel_codegen_split_count=1")

os.environ["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS"), FAST_COMPILE) if f)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: a long launch (large world sizes, real architectures, third-party "
                   "trainers, the example); `pytest -m 'not slow' tests` is the quick tier")
