"""An engine's hash_seed from a file or the environment (issue 30 item 2): read once at load,
errors that name the file or variable and never the seed."""
from __future__ import annotations

from pathlib import Path

import pytest

from quilld.config import Config, engine_from, load
from quilld.errors import ConfigError

BASE = {"id": "e", "url": "http://127.0.0.1:8000", "model": "m", "prefix_caching_hash_algo": "xxhash"}


def test_a_seed_from_a_file_is_read_stripped_and_kept_secret(tmp_path: Path):
    f = tmp_path / "seed"
    f.write_text("913577\n")
    e = engine_from(BASE | {"hash_seed_file": str(f)}, "t")
    assert e.hash_seed == "913577" and "913577" not in repr(e)
    assert Config(engines=(e,)).redacted()["engines"][0]["hash_seed"] == "***"


def test_a_seed_from_the_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ENGINE_E_SEED", "31337")
    assert engine_from(BASE | {"hash_seed": "env:ENGINE_E_SEED"}, "t").hash_seed == "31337"
    monkeypatch.delenv("ENGINE_E_SEED")
    with pytest.raises(ConfigError, match="environment variable 'ENGINE_E_SEED', which is unset or empty"):
        engine_from(BASE | {"hash_seed": "env:ENGINE_E_SEED"}, "t")


def test_a_missing_empty_or_doubled_seed_file_is_an_error_at_load(tmp_path: Path):
    missing = tmp_path / "nope"
    conf = tmp_path / "q.toml"
    conf.write_text(f'[[engines]]\nid = "e"\nmodel = "m"\nurl = "http://127.0.0.1:8000"\n'
                    f'hash_seed_file = "{missing}"\n')
    with pytest.raises(ConfigError, match=r"hash_seed_file '.*nope' cannot be read: No such file"):
        load(str(conf), {})
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(ConfigError, match="is empty"):
        engine_from(BASE | {"hash_seed_file": str(empty)}, "t")
    with pytest.raises(ConfigError, match="hash_seed or hash_seed_file, not both"):
        engine_from(BASE | {"hash_seed_file": str(empty), "hash_seed": "1"}, "t")
