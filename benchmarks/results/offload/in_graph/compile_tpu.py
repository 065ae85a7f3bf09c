"""Compile one torch_xla program (StableHLO text from xm.get_stablehlo, or HLO text) with libtpu
for a TPU topology that is not here, optionally after giving main's arguments/results XLA memory
kinds, and print libtpu's compiled memory statistics as JSON.

Run with the TPU compiler's interpreter (python -m xla_fsdp.aot install makes it):
  ~/.cache/xla_fsdp/tpu-compiler/bin/python compile_tpu.py PROGRAM.{mlir,hlo} \
      [--topology v5e:2x2] [--donate] [--host-args] [--host-results] [--out-hlo OUT]

Roles of main's arguments are found from the program itself (one chip, no SPMD):
  state  = an argument whose value goes straight into annotate_device_placement("device")
           (torch_xla's place_to_device), or, with --state-args, the listed argument numbers;
  grad   = a large argument used more than once (the AdamW update reads g three times);
  param  = any other large argument.  Scalars (torch_xla passes Python floats as arguments)
           are left alone.
--donate marks param and state arguments jax.buffer_donor (what torch_xla's sync donates: the
tensors updated in place); --host-args gives the state arguments mhlo.memory_kind="pinned_host"
and --host-results does so for results produced by annotate_device_placement("pinned_host"):
exactly the attributes jax emits for NamedSharding(..., memory_kind="pinned_host").
"""
import argparse, json, re, sys, time

FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
          "temp_size_in_bytes", "peak_memory_in_bytes", "total_allocation_bytes",
          "host_argument_size_in_bytes", "host_output_size_in_bytes", "host_alias_size_in_bytes",
          "host_temp_size_in_bytes")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("program")
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--donate", action="store_true")
    ap.add_argument("--host-args", action="store_true")
    ap.add_argument("--host-results", action="store_true")
    ap.add_argument("--state-args", default="")
    ap.add_argument("--out-hlo")
    ap.add_argument("--out-mlir")
    a = ap.parse_args()

    import numpy as np
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax, xla_client
    from jax._src.lib.mlir import ir
    from jax.experimental import topologies
    import jaxlib._hlo as hlo_api

    text = open(a.program).read()
    result = {"program": a.program, "topology": a.topology, "donate": a.donate,
              "host_args": a.host_args, "host_results": a.host_results}
    with mlir.make_ir_context():
        if a.program.endswith(".hlo"):
            # torch_xla 2.9 prints place_to_host's custom call with api_version=API_VERSION_UNSPECIFIED,
            # which XLA's HLO text parser refuses; torch_xla itself hands XLA a proto, not text.
            text = text.replace("api_version=API_VERSION_UNSPECIFIED", "api_version=API_VERSION_ORIGINAL")
            text = _jax.mlir.hlo_to_stablehlo(
                hlo_api.hlo_module_from_text(text).as_serialized_hlo_module_proto())
            text = ir.Module.parse(text).operation.get_asm()
        module = ir.Module.parse(text)
        asm = module.operation.get_asm()
        main_fn = [op for op in module.body.operations
                   if ir.StringAttr(op.attributes["sym_name"]).value == "main"][0]
        block = main_fn.regions[0].blocks[0]
        nargs = len(block.arguments)
        body = asm[asm.index("@main("):]
        body = body[body.index("{"):]  # after the signature
        roles = []
        state_listed = {int(x) for x in a.state_args.split(",") if x}
        for i, arg in enumerate(block.arguments):
            t = ir.RankedTensorType(arg.type)
            if t.rank == 0:
                roles.append("scalar"); continue
            name = f"%arg{i}"
            uses = len(re.findall(re.escape(name) + r"\b", body))
            to_device = re.search(r"annotate_device_placement\(" + re.escape(name) +
                                  r"\)[^\n]*_xla_buffer_placement = \"device\"", body)
            if i in state_listed or to_device:
                roles.append("state")
            elif uses > 1:
                roles.append("grad")
            else:
                roles.append("param")
        ret = re.search(r"(?:stablehlo|func)\.return ([^:\n]*):", body) or re.search(r"\breturn ([^:\n]*):", body)
        ret_vals = [v.strip() for v in ret.group(1).split(",")]
        res_host = []
        for v in ret_vals:
            m = re.search(re.escape(v) + r" = stablehlo\.custom_call @annotate_device_placement\([^\n]*"
                          r"_xla_buffer_placement = \"pinned_host\"", body)
            res_host.append(bool(m))
        result["roles"] = {r: roles.count(r) for r in ("param", "grad", "state", "scalar")}
        result["results_from_place_to_host"] = sum(res_host)
        def existing(key, n):  # attributes the program already has (kept)
            if key not in main_fn.attributes:
                return [{} for _ in range(n)]
            out = []
            for attrs in ir.ArrayAttr(main_fn.attributes[key]):
                attrs = ir.DictAttr(attrs)
                out.append({attrs[j].name: attrs[j].attr for j in range(len(attrs))})
            return out
        old_args = existing("arg_attrs", nargs)
        old_res = existing("res_attrs", len(ret_vals))
        result["given_memory_kinds"] = {
            "args": [str(d["mhlo.memory_kind"]) for d in old_args if "mhlo.memory_kind" in d],
            "results": [str(d["mhlo.memory_kind"]) for d in old_res if "mhlo.memory_kind" in d]}
        arg_attrs = []
        for i, r in enumerate(roles):
            d = dict(old_args[i])
            if a.donate and r in ("param", "state"):
                d["jax.buffer_donor"] = ir.BoolAttr.get(True)
            if a.host_args and r == "state":
                d["mhlo.memory_kind"] = ir.StringAttr.get("pinned_host")
            arg_attrs.append(ir.DictAttr.get(d))
        main_fn.attributes["arg_attrs"] = ir.ArrayAttr.get(arg_attrs)
        if a.host_results:
            main_fn.attributes["res_attrs"] = ir.ArrayAttr.get(
                [ir.DictAttr.get({**old, "mhlo.memory_kind": ir.StringAttr.get("pinned_host")} if h
                                 else old) for h, old in zip(res_host, old_res)])
        if a.out_mlir:
            open(a.out_mlir, "w").write(module.operation.get_asm(large_elements_limit=16))
        devices = topologies.get_topology_desc(platform="tpu", topology_name=a.topology).devices
        options = compiler.get_compile_options(num_replicas=1, num_partitions=1,
                                               device_assignment=np.arange(1).reshape(1, 1))
        t0 = time.monotonic()
        try:
            exe = devices[0].client.compile(module, executable_devices=xla_client.DeviceList(
                tuple(devices[:1])), compile_options=options)
        except Exception as exc:
            result.update(status="error", message=str(exc)[:2000])
            print(json.dumps(result)); return
    result["compile_seconds"] = round(time.monotonic() - t0, 2)
    st = exe.get_compiled_memory_stats()
    result["status"] = "ok"
    result["memory_MiB"] = {k: round(getattr(st, k) / 2 ** 20, 2) for k in FIELDS}
    opt = "\n\n".join(m.to_string() for m in exe.hlo_modules())
    header = opt.split("\n", 1)[0]
    m = re.search(r"entry_computation_layout=\{(.*)\}", header)
    result["entry_params_in_S5"] = m.group(1).split("->")[0].count("S(5)") if m else None
    result["entry_results_in_S5"] = m.group(1).split("->")[1].count("S(5)") if m else None
    # copy-start's result is (destination, source, context): S(5) on the source = host -> HBM
    starts = re.findall(r"= \((\S+), (\S+), u32\[\]\{:S\(2\)\}\) copy-start\(", opt)
    result["copies_host_to_device"] = sum("S(5)" in src and "S(5)" not in dst for dst, src in starts)
    result["copies_device_to_host"] = sum("S(5)" in dst and "S(5)" not in src for dst, src in starts)
    if a.out_hlo:
        open(a.out_hlo, "w").write(opt)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
