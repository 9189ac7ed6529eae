"""The profile's small-batch matmul rate (gemv_bandwidth): optional in the TOML (absent: decode reads weights at
device_bandwidth, as before), validated, written back, and measured by `measure` over weights larger than the
last-level cache."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hpcinfer.errors import ConfigError
from hpcinfer.offload.profile import PRESETS, gemv_bandwidth, last_level_cache, load_profile, measure, save_profile

BASE = PRESETS["t4-16gb"]


def test_presets_have_none_and_decode_at_the_streaming_bandwidth():
    for profile in PRESETS.values():
        assert profile.gemv_bandwidth is None
        assert profile.decode_bandwidth == profile.device_bandwidth
        assert "gemv_bandwidth" not in profile.to_toml()


def test_decode_bandwidth_is_the_smaller_of_the_two():
    assert dataclasses.replace(BASE, gemv_bandwidth=50e9).decode_bandwidth == 50e9
    assert dataclasses.replace(BASE, gemv_bandwidth=500e9).decode_bandwidth == BASE.device_bandwidth


@pytest.mark.parametrize("value", [0.0, -1.0, True, "fast"])
def test_gemv_bandwidth_is_validated(value):
    with pytest.raises(ValueError, match="gemv_bandwidth"):
        dataclasses.replace(BASE, gemv_bandwidth=value)


def test_toml_round_trip_with_and_without_the_key(tmp_path):
    with_key = dataclasses.replace(BASE, gemv_bandwidth=12.5e9)
    save_profile(with_key, str(tmp_path / "a.toml"))
    assert "gemv_bandwidth = 1.25e+10" in (tmp_path / "a.toml").read_text()
    assert load_profile(str(tmp_path / "a.toml")) == with_key
    save_profile(BASE, str(tmp_path / "b.toml"))                   # an older file: no key, None
    assert load_profile(str(tmp_path / "b.toml")).gemv_bandwidth is None
    (tmp_path / "c.toml").write_text((tmp_path / "b.toml").read_text() + 'gemv_bandwidth = "fast"\n')
    with pytest.raises(ConfigError, match="gemv_bandwidth"):
        load_profile(str(tmp_path / "c.toml"))


def test_gemv_measurement_covers_more_than_the_cache():
    assert last_level_cache() >= 2**20
    rate = gemv_bandwidth(np.ones(1024, np.float32), tokens=(1,))     # too small: it allocates 4x the cache
    assert 1e8 < rate < 1e13


def test_measure_records_it(tmp_path):
    profile = measure(str(tmp_path), size=2**20)
    assert profile.gemv_bandwidth is not None and profile.gemv_bandwidth > 0
    assert profile.decode_bandwidth <= profile.device_bandwidth
