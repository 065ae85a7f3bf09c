"""Suite-wide XLA:CPU settings.

Nearly all of a launch's time is XLA:CPU compiling step graphs, and nearly all of that is
LLVM optimising their machine code: 4 to 24 s a graph on this 2-core machine, under 1 s
without. Every comparison in the suite is between runs compiled with the same flags, and
what the tests read from XLA (collectives, barriers, aliasing in the traced HLO) comes
before code generation, so the suite compiles unoptimised code. A test that reads XLA's
optimised module (``tests/_xla/test_donation_order.py``) adds its dump flags to these: what
it reads is decided by XLA's HLO passes, before code generation.
"""
import os

FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                "--xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_parallel_codegen_split_count=1")

os.environ["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS"), FAST_COMPILE) if f)


def pytest_configure(config):
    # pytest-xdist (3.6 on) reorders loadscope's modules by their number of tests, which
    # would start the one-test modules of HEAVY_FIRST last; keep the order below instead
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    config.addinivalue_line(
        "markers", "slow: a long launch (large world sizes, whole compiled or resumed steps, "
                   "real architectures, third-party trainers, the example, the larger TPU "
                   "plans); `pytest -n 2 --dist loadscope -m 'not slow' tests` is the quick tier")


# The modules that take a minute or more, heaviest first (seconds of one run alone on 2
# cores, pytest --durations). The README runs the suite on two workers with
# `--dist loadscope`: each module runs whole on one worker, so its module-scoped launches
# run once, and a worker takes the next module from the front of this order when it is
# free. Starting the long modules first lets the two workers finish together instead of one
# of them starting a five-minute module while the other is done. Other modules keep their
# order after these.
HEAVY_FIRST = (
    "tests/fully_sharded/test_compiled.py",        # 273
    "tests/fully_sharded/test_parity.py",          # 269
    "tests/aot/test_plan.py",                      # 267
    "tests/fully_sharded/test_matrix.py",          # 250
    "tests/aot/test_large_model.py",               # 230
    "tests/fully_sharded/test_hf_models.py",       # 130
    "tests/compat/test_transformers_5.py",         # 116
    "tests/checkpoint/test_roundtrip.py",          # 84
    "tests/compat/test_peft.py",                   # 68
    "tests/aot/test_alternatives.py",              # 67
    "tests/launch/test_behaviour.py",              # 65
    "tests/compat/test_hf_trainer.py",             # 63
    "tests/examples/test_train_lm.py",             # 61
    "tests/aot/test_cli.py",                       # 55
    "tests/compat/test_surface.py",                # 54
    "tests/launch/test_collectives.py",            # 48
    "tests/checkpoint/dcp/test_roundtrip.py",      # 43
    "tests/launch/test_data_parallel.py",          # 40
    "tests/checkpoint/manager/test_preemption.py", # 39
)


def pytest_collection_modifyitems(config, items):
    place = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: place.get(item.nodeid.split("::")[0], len(HEAVY_FIRST)))
