from pathlib import Path

import pytest

from streamtune.stack import StackConfig


def test_env_and_flags_set_ports_and_dirs(tmp_path):
    env = {"STREAMTUNE_HOME": str(tmp_path), "STREAMTUNE_KAFKA_PORT": "19092"}
    config = StackConfig.from_env(env, mongo_port=37017)
    assert config.home == tmp_path
    assert config.data_dir == tmp_path / "data"
    assert config.kafka_bootstrap == "127.0.0.1:19092"
    assert config.mongo_port == 37017


def test_flag_wins_over_env(tmp_path):
    config = StackConfig.from_env({"STREAMTUNE_HOME": str(tmp_path), "STREAMTUNE_MLFLOW_PORT": "5001"},
                                  mlflow_port=5002)
    assert config.mlflow_uri == "http://127.0.0.1:5002"


def test_clashing_ports_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="distinct"):
        StackConfig.from_env({"STREAMTUNE_HOME": str(tmp_path)}, kafka_port=5000)


def test_out_of_range_port_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="outside"):
        StackConfig(home=Path(tmp_path), data_dir=Path(tmp_path), kafka_port=70000)
