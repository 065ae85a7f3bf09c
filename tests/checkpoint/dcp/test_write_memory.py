"""What a DCP write holds at once: one file's worth, not the checkpoint. DCP's writer keeps
every tensor of a file until the file closes, and each ``torch.save`` it makes holds its
tensor in a reference cycle (see the Notes in ``writers.dcp_files`` and ``formats.dcp.planners``); the
checkpoint here is 8 tensors of 48 MiB written through ``write_alone`` (what the offline
conversion does), each read only when the writer asks for it. Resident anonymous memory
while writing must stay well under the 384 MiB that holding them all would take. And the
files are the ones a save named (see [Note: naming DCP's files])."""
import dataclasses
import os
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from xla_fsdp.checkpoint.formats.dcp.planners import ChunkSavePlanner, OnDemand
from xla_fsdp.checkpoint.writers.dcp_files import write_alone
from ...support.checks import every

COUNT, NUMEL = 8, 12 << 20  # float32: 48 MiB each, above glibc's largest mmap threshold


def _anon_bytes():
    with open("/proc/self/status") as f:
        return int(re.search(r"RssAnon:\s+(\d+) kB", f.read()).group(1)) << 10


def test_a_write_holds_one_file_worth(tmp_path):
    before = _anon_bytes()
    seen = []

    def read(i):
        seen.append(_anon_bytes() - before)
        return torch.full((NUMEL,), float(i))
    wholes = {f"t{i}": OnDemand(torch.Size([NUMEL]), torch.float32, lambda i=i: read(i))
              for i in range(COUNT)}
    write_alone(str(tmp_path), ChunkSavePlanner({}, wholes, {}, {k: (k,) for k in wholes}))
    seen.append(_anon_bytes() - before)
    assert len(seen) == COUNT + 1
    assert max(seen) < 3 * NUMEL * 4, [s >> 20 for s in seen]  # MiB, for the message
    back = {f"t{i}": torch.empty(NUMEL) for i in (0, COUNT - 1)}
    dcp.load(back, checkpoint_id=str(tmp_path), no_dist=True)
    assert every(torch.equal(back[f"t{i}"], torch.full((NUMEL,), float(i))) for i in (0, COUNT - 1))


def test_a_writer_that_names_files_its_own_way_fails_the_save_and_leaves_nothing(
        tmp_path, monkeypatch):
    # see [Note: naming DCP's files]: a torch whose writer ignored the prefix a save gives
    from torch.distributed.checkpoint import FileSystemWriter
    original = FileSystemWriter.write_data

    def own_names(self, plan, planner):
        renamed = type(plan.storage_data)(prefix="renamed_")
        return original(self, dataclasses.replace(plan, storage_data=renamed), planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", own_names)
    wholes = {"t": OnDemand(torch.Size([4]), torch.float32, lambda: torch.ones(4))}
    with pytest.raises(RuntimeError, match=r"wrote .*renamed_0\.distcp, where xla_fsdp "
                                           r"expects __0_[0-9a-f]+_0_<n>\.distcp"):
        write_alone(str(tmp_path), ChunkSavePlanner({}, wholes, {}, {"t": ("t",)}))
    assert os.listdir(tmp_path) == []
