"""``python -m xla_fsdp.launch script.py [args...]``: runs a script written for torch_xla's
FSDP and launchers, unchanged, on this package: torch_xla's FSDP imports resolve to
xla_fsdp (``patch_torch_xla``), and with no accelerator ``xmp.spawn`` and
``torch_xla.launch`` run on virtual CPU devices (see [Note: routing torch_xla's
launchers])."""
import os
import runpy
import sys


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    script = argv[0]
    if not os.path.isfile(script):
        raise SystemExit(f"python -m xla_fsdp.launch: no such script: {script}")
    from ..compat.patch import patch_torch_xla
    from .torch_xla_entry_points import patch_spawned_children, route_torch_xla_launchers
    route_torch_xla_launchers()   # first: it imports torch_xla, choosing the device quietly
    patch_torch_xla()
    patch_spawned_children()
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    # run as __main__, so that its `if __name__ == "__main__":` runs and the launcher's
    # device process finds the functions it defines by the script's path
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
