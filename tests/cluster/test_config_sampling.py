"""Config for sampled requests: `asd.sampled` (only on ASD arms) and `serving.defaults`, errors with paths."""

import pytest

from actors.requests import ArmSpec
from cluster.config import ConfigError, load_config, parse_config
from policies.asd import ASDConfig


def minimal(**overrides) -> dict:
    return {"name": "t", "target": {"source": "embedded:smollm2", "served_name": "smol"}, **overrides}


def test_asd_sampled_defaults_to_exact_and_reaches_the_arm_spec():
    cfg = parse_config(minimal(arms=[
        {"name": "exact"},
        {"name": "asd", "verification": "asd", "asd": {}},
        {"name": "relaxed", "verification": "asd", "asd": {"g": 1.0, "budget": 2.0, "sampled": "relaxed"}},
    ]))
    specs = [arm.to_arm_spec() for arm in cfg.arms]
    assert [s.sampled for s in specs] == ["exact", "exact", "relaxed"]
    assert specs[2].asd == ASDConfig(g=1.0, max_relaxed_per_block=2, budget=2.0)


def test_asd_sampled_on_an_exact_arm_names_its_path_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "name: t\n"
        "target: {source: embedded:smollm2, served_name: smol}\n"
        "arms:\n"
        "  - name: asd\n"
        "    verification: asd\n"
        "    asd: {sampled: relaxed}\n"
        "  - name: exact\n"
        "    verification: exact\n"
        "    asd: {sampled: relaxed}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "arms[1].asd (line 9)" in str(err.value) and "only allowed when verification is 'asd'" in str(err.value)


@pytest.mark.parametrize("overrides, fragment", [
    ({"arms": [{"name": "a", "verification": "asd", "asd": {"sampled": "loose"}}]}, "arms[0].asd.sampled"),
    ({"arms": [{"name": "a", "asd": {"sampled": "exact"}}]}, "arms[0].asd: Value error, asd settings"),
    ({"serving": {"defaults": {"temprature": 0}}}, "serving.defaults.temprature: Extra inputs are not permitted"),
    ({"serving": {"defaults": {"seed": 1}}}, "serving.defaults.seed: Extra inputs are not permitted"),
    ({"serving": {"defaults": {"temperature": -0.5}}}, "serving.defaults.temperature"),
    ({"serving": {"defaults": {"top_p": 0}}}, "serving.defaults.top_p"),
    ({"serving": {"defaults": {"top_k": 0}}}, "serving.defaults.top_k"),
])
def test_bad_sampling_settings_fail_at_load_with_their_path(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        parse_config(minimal(**overrides))
    assert fragment in str(err.value)


def test_serving_defaults_are_unset_unless_given():
    defaults = parse_config(minimal()).serving.defaults
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (None, None, None)
    greedy = parse_config(minimal(serving={"defaults": {"temperature": 0, "top_k": 40}})).serving.defaults
    assert (greedy.temperature, greedy.top_p, greedy.top_k) == (0.0, None, 40)


def test_arm_spec_rejects_a_relaxed_exact_arm():
    with pytest.raises(ValueError, match="sampled 'relaxed' needs verification 'asd'"):
        ArmSpec("e", sampled="relaxed")
    with pytest.raises(ValueError, match="sampled must be one of"):
        ArmSpec("a", "asd", ASDConfig(g=1, max_relaxed_per_block=1, budget=1), sampled="loose")
