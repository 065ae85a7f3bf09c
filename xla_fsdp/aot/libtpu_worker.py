"""Runs in the TPU compiler's interpreter (Python 3.12 with ``jax[tpu]``), never in the
training process: ``python libtpu_worker.py REQUEST.json RESPONSE.json``.

It compiles HLO modules with libtpu for a TPU slice that is not here (jax's compile-only
topology client) and writes what the compiler says about each: memory per chip, FLOPs and
bytes accessed, the optimized HLO, or the compiler's refusal. It imports nothing of
``xla_fsdp`` (torch is not installed beside jax) and only the standard library at import,
so that the training process can import this module too.

The request: ``{"topology": "v5e:2x4", "programs": [{"hlo": path, "replicas": R,
"partitions": P, "out_hlo": path}]}``; the response: ``{"usable_hbm_bytes": int,
"coords": [[x, y, z], ...] (each device's place in the grid, in the order replicas and
partitions are assigned), "programs": [{"status": "ok" | "oom" | "error", "message": str,
"memory": {...}, "cost": {...}, "compile_seconds": float}]}``.

[Note: donors through StableHLO] HLO text carries the buffers a program may reuse for its
outputs as ``buffer_donor={...}`` (or ``input_output_alias={...}``) in the module header.
The conversion to StableHLO, which this client compiles, drops both, and without them the
compiler keeps every input alive beside its replacement (a small FSDP step's peak went from
141.5 to 189.7 MiB). They are put back as ``jax.buffer_donor`` on the entry's arguments,
which is how jax itself marks donated arguments; the compiler then pairs them with outputs.

[Note: shardings the partitioner chooses] An SPMD program (``partitions`` > 1) names the
shardings its code chose (``mark_sharding``). torch_xla lets the partitioner choose the
others for the outputs (``allow_spmd_sharding_propagation_to_output``), and the next step
receives those tensors sharded as chosen. A traced step's inputs carry only the chosen
shardings (nothing ran to shard the others), so the partitioner is let choose those of the
inputs as well; it picks what the previous step's outputs would have had (an optimizer
state is sharded like its parameter). Checked: a planned FSDPv2 step and the same step
executed on virtual devices compile to the same memory per chip.

[Note: Pallas kernels through StableHLO] A Pallas kernel (torch_xla's flash or splash
attention) is a ``tpu_custom_call``. jax 0.12's conversion to StableHLO gives every custom
call an empty ``result_tilings`` attribute, which the client cannot downgrade to the
StableHLO version libtpu reads ("failed to legalize operation 'vhlo.custom_call_v2'");
empty, it says nothing, so it is dropped. And torch_xla's programs are GSPMD programs: with
jax's default, the Shardy partitioner, XLA keeps the calls splash attention makes to its
``shmap_body`` computations un-inlined and the compiler refuses them (or aborts), so they
are compiled with GSPMD, which is what torch_xla's own client does.
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

_OOM = re.compile(r"required for (?P<what>[^(]*?) \((?P<need>[\d.]+)(?P<need_unit>[KMGT]?)\) "
                  r"exceeds available HBM \((?P<have>[\d.]+)(?P<have_unit>[KMGT]?)\)")
_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
_MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                  "temp_size_in_bytes", "generated_code_size_in_bytes", "peak_memory_in_bytes")


def donors_in_header(hlo_text: str) -> list:
    """Parameter numbers the module header lets the compiler reuse (see [Note: donors
    through StableHLO])."""
    header = hlo_text.split("\n", 1)[0]
    found = set()
    for key in ("buffer_donor", "input_output_alias"):
        at = header.find(key + "={")
        if at < 0:
            continue
        depth, end = 0, at + len(key) + 1
        for end in range(at + len(key) + 1, len(header)):
            depth += {"{": 1, "}": -1}.get(header[end], 0)
            if depth == 0:
                break
        body = header[at + len(key) + 2:end]
        if key == "buffer_donor":
            found.update(int(m) for m in re.findall(r"\((\d+),", body))
        else:  # {output index}: (parameter, {index}, kind)
            found.update(int(m) for m in re.findall(r":\s*\((\d+),", body))
    return sorted(found)


def oom_figures(message: str) -> dict:
    m = _OOM.search(message)
    if not m:
        return {}
    return {"required_bytes": int(float(m.group("need")) * _UNITS[m.group("need_unit")]),
            "available_bytes": int(float(m.group("have")) * _UNITS[m.group("have_unit")]),
            "required_for": m.group("what").strip()}


def _stablehlo_with_donors(hlo_text: str, ir, mlir_api, hlo_api):
    module = hlo_api.hlo_module_from_text(hlo_text)
    parsed = ir.Module.parse(mlir_api.hlo_to_stablehlo(module.as_serialized_hlo_module_proto()))
    _drop_empty_result_tilings(parsed, ir)
    donors = set(donors_in_header(hlo_text))
    for op in parsed.body.operations:
        if ir.StringAttr(op.attributes["sym_name"]).value != "main":
            continue
        old = list(ir.ArrayAttr(op.attributes["arg_attrs"])) if "arg_attrs" in op.attributes \
            else [ir.DictAttr.get({}) for _ in op.regions[0].blocks[0].arguments]
        new = []
        for i, attrs in enumerate(old):
            attrs = ir.DictAttr(attrs)
            entries = {attrs[j].name: attrs[j].attr for j in range(len(attrs))}
            if i in donors:
                entries["jax.buffer_donor"] = ir.BoolAttr.get(True)
            new.append(ir.DictAttr.get(entries))
        op.attributes["arg_attrs"] = ir.ArrayAttr.get(new)
    return parsed


def _drop_empty_result_tilings(module, ir) -> None:
    """See [Note: Pallas kernels through StableHLO]."""
    def drop(op):
        if op.name == "stablehlo.custom_call" and "result_tilings" in op.attributes and all(
                len(ir.ArrayAttr(t)) == 0 for t in ir.ArrayAttr(op.attributes["result_tilings"])):
            del op.attributes["result_tilings"]
        return ir.WalkResult.ADVANCE
    module.operation.walk(drop)


def _usable_hbm(devices, compile_one) -> int:
    """The HBM the compiler lets a program use on one chip: it says so when refusing a
    program too large for any chip."""
    shape = "tensor<16384x1048576xf32>"  # 64 GiB, in and out: more than any chip has
    probe = (f"module @xla_fsdp_hbm_probe {{\n  func.func public @main(%a: {shape}) -> {shape} "
             f"{{\n    %0 = stablehlo.add %a, %a : {shape}\n    return %0 : {shape}\n  }}\n}}")
    try:
        compile_one(probe, devices[:1], 1, 1)
    except Exception as exc:  # the refusal is the answer
        return oom_figures(str(exc)).get("available_bytes", 0)
    return 0


def main(request_path: str, response_path: str) -> None:
    import numpy as np
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax, xla_client
    from jax._src.lib.mlir import ir
    from jax.experimental import topologies
    import jaxlib._hlo as hlo_api

    request = json.loads(Path(request_path).read_text())
    devices = topologies.get_topology_desc(platform="tpu",
                                           topology_name=request["topology"]).devices

    def compile_one(module, devs, replicas, partitions, spmd=False):
        with mlir.make_ir_context():
            if isinstance(module, str):
                module = ir.Module.parse(module)
            assignment = np.arange(replicas * partitions).reshape(replicas, partitions)
            options = compiler.get_compile_options(num_replicas=replicas,
                                                   num_partitions=partitions,
                                                   device_assignment=assignment)
            # torch_xla's programs carry GSPMD shardings (see [Note: Pallas kernels through
            # StableHLO])
            options.executable_build_options.use_shardy_partitioner = False
            if spmd:  # see [Note: shardings the partitioner chooses]
                build = options.executable_build_options
                build.allow_spmd_sharding_propagation_to_output = [True]
                build.allow_spmd_sharding_propagation_to_parameters = [True]
            return devs[0].client.compile(module, executable_devices=xla_client.DeviceList(
                tuple(devs[:replicas * partitions])), compile_options=options)

    response = {"usable_hbm_bytes": _usable_hbm(devices, compile_one), "programs": [],
                # replica (or partition) i runs on devices[i]: where each chip sits
                "coords": [list(d.coords) for d in devices]}
    for program in request["programs"]:
        text = Path(program["hlo"]).read_text()
        started = time.monotonic()
        entry = {"status": "ok", "message": ""}
        try:
            with mlir.make_ir_context():
                module = _stablehlo_with_donors(text, ir, _jax.mlir, hlo_api)
                executable = compile_one(module, devices, program["replicas"],
                                         program["partitions"], program["partitions"] > 1)
            stats = executable.get_compiled_memory_stats()
            entry["memory"] = {k: int(getattr(stats, k)) for k in _MEMORY_FIELDS}
            cost = executable.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            entry["cost"] = {k: float(cost.get(k, 0.0))
                             for k in ("flops", "bytes accessed", "transcendentals")}
            Path(program["out_hlo"]).write_text(
                "\n\n".join(m.to_string() for m in executable.hlo_modules()))
        except Exception as exc:
            message = str(exc)
            entry = {"status": "oom" if "CompileTimeHbmOom" in message else "error",
                     "message": message, "oom": oom_figures(message)}
        entry["compile_seconds"] = time.monotonic() - started
        response["programs"].append(entry)
    Path(response_path).write_text(json.dumps(response))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
