"""Compiles one HLO text file with libtpu directly, by a route of its own (XlaComputation ->
MLIR, donations written into the entry's signature), and prints its memory statistics as
JSON: the check on what ``xla_fsdp.aot`` reports. Run by the TPU compiler's interpreter:
``python libtpu_direct.py HLO TOPOLOGY REPLICAS``."""
import json
import re
import sys


def main(path: str, topology: str, replicas: int) -> None:
    import numpy as np
    import jaxlib._hlo as hlo
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax, xla_client
    from jax._src.lib.mlir import ir
    from jax.experimental import topologies

    text = open(path).read()
    header = text.split("\n", 1)[0]
    donors = {int(n) for n in re.findall(r"\((\d+), \{\}\)", header.split("buffer_donor=")[1])} \
        if "buffer_donor=" in header else set()
    computation = hlo.XlaComputation(hlo.hlo_module_from_text(text)
                                     .as_serialized_hlo_module_proto())
    source = _jax.mlir.xla_computation_to_mlir_module(computation)
    lines = source.split("\n")
    for i, line in enumerate(lines):
        if re.search(r"func\.func (public )?@main\(", line):
            lines[i] = re.sub(r"(%arg(\d+): tensor<[^>]*>)",
                              lambda m: m.group(1) + (" {jax.buffer_donor = true}"
                                                      if int(m.group(2)) in donors else ""),
                              line)
    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    with mlir.make_ir_context():
        module = ir.Module.parse("\n".join(lines))
        options = compiler.get_compile_options(
            num_replicas=replicas, num_partitions=1,
            device_assignment=np.arange(replicas).reshape(replicas, 1))
        executable = devices[0].client.compile(
            module, executable_devices=xla_client.DeviceList(tuple(devices[:replicas])),
            compile_options=options)
    stats = executable.get_compiled_memory_stats()
    print(json.dumps({"peak": stats.peak_memory_in_bytes, "donors": len(donors),
                      "flops": executable.cost_analysis()["flops"]}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
