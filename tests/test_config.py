"""config.py: typed loading of nested frozen dataclasses, and errors that name the key."""

import dataclasses

import pytest

from seqax.config import ConfigError, config_from_dict, load_config


@dataclasses.dataclass(frozen=True)
class Inner:
    rate: float
    name: str


@dataclasses.dataclass(frozen=True)
class Outer:
    steps: int
    inner: Inner
    flag: bool


def test_config_loads_nested_frozen_dataclasses():
    c = config_from_dict(Outer, {"steps": 3, "inner": {"rate": 1, "name": "x"}, "flag": True})
    assert c == Outer(3, Inner(1.0, "x"), True)
    assert isinstance(c.inner.rate, float)  # an int where a float is expected is converted
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.steps = 4


@pytest.mark.parametrize(
    "values,message",
    [
        ({"steps": 3, "inner": {"rate": 1.0}, "flag": True},
         r"config is missing key inner.name \(set it in the YAML or with \+inner.name=...\)"),
        ({"steps": 3, "inner": {"rate": 1.0, "name": "x", "nmae": 2}, "flag": True},
         r"unknown config key inner.nmae; did you mean inner.name\? \(known keys here: name, rate\)"),
        ({"steps": "3", "inner": {"rate": 1.0, "name": "x"}, "flag": True}, r"config key steps must be int, got '3'"),
        ({"steps": True, "inner": {"rate": 1.0, "name": "x"}, "flag": True}, r"config key steps must be int, got True"),
        ({"steps": 3, "inner": 5, "flag": True}, r"config key inner must be a mapping, got 5"),
    ],
)
def test_config_errors_name_the_key(values, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(Outer, values)


@pytest.mark.parametrize("name,overrides,message", [
    ("local_test_synthetic", ["model.d_modl=4"], r"^config local_test_synthetic has no key model.d_modl; did you mean "
                                                 r"model.d_model\?$"),
    ("local_test_synthetc", [], r"^there is no config 'local_test_synthetc' in \S+; did you mean "
                                r"local_test_synthetic\?"),
    ("local_test_synthetic", ["~training.stepz"], r"^config local_test_synthetic: Could not delete from config\. "
                                                   r"'training.stepz' does not exist$"),
])
def test_hydras_errors_are_config_errors(name, overrides, message):
    """What config.load_config (the benchmarks' loader) raises where hydra's composition fails."""
    with pytest.raises(ConfigError, match=message):
        load_config(name, ["+paths.model_name=x", *overrides])


def test_a_key_with_a_default_is_set_without_a_plus_whether_or_not_the_yaml_has_it():
    """training.expert_bias_rate is in no YAML (its default is the dataclass's): `key=value` sets it as a key the
    YAML has is set, and `+key=value` still works; a key the YAML has is overridden as before."""
    plain = load_config("local_test_synthetic", ["+paths.model_name=x", "training.expert_bias_rate=0.5",
                                                 "model.attention_kernel=reference",
                                                 "+training.expert_balance_loss=0.1"])
    assert plain.training.expert_bias_rate == 0.5 and plain.training.expert_balance_loss == 0.1
    assert plain.model.attention_kernel == "reference"
    assert load_config("local_test_synthetic", ["+paths.model_name=x"]).training.expert_bias_rate == 0.001
