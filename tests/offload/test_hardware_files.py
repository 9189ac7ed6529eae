"""The committed hardware files (inputs/hardware/*.toml): each is its preset (offload/profile.PRESETS) written by
HardwareProfile.to_toml, reads back to the same hardware, and `hpcinfer plan --hardware FILE` plans with it as
with the preset's name."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcinfer.cli import main
from hpcinfer.offload.profile import PRESETS, load_profile, resolve_profile

FILES = Path(__file__).resolve().parents[2] / "inputs" / "hardware"
NAMES = ["dgx-a100-40gb", "dgx-h100-80gb", "h100-80gb"]


@pytest.mark.parametrize("name", NAMES)
def test_file_is_the_preset(name):
    path = FILES / f"{name}.toml"
    assert load_profile(str(path)) == PRESETS[name] == resolve_profile(str(path))
    text = path.read_text()
    assert text[text.index("# hpcinfer hardware profile"):] == PRESETS[name].to_toml()   # regenerated, not edited


@pytest.mark.parametrize("name", ["dgx-a100-40gb", "dgx-h100-80gb"])
def test_plan_reads_the_file_as_the_preset(capsys, name):
    args = ["plan", "--model", "tiny-moe", "--gpus", "16", "--batch", "16", "--prompt-len", "16", "--gen-len", "4"]
    assert main(args + ["--hardware", name]) == 0
    by_name = capsys.readouterr().out
    assert main(args + ["--hardware", str(FILES / f"{name}.toml")]) == 0
    assert capsys.readouterr().out == by_name
