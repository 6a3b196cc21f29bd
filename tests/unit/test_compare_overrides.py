"""launch.compare hands every run the sweep's whole train/model config as overrides: nested groups
(train.chaos) and lists (a fault list) must come out as overrides Hydra parses back to the same values."""

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from launch.compare import section_overrides
from launch.config import CONFIG_DIR


def test_every_train_field_round_trips_through_the_overrides():
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", ["train.chaos.mtbf_s=30", "train.fail_at_step=[5,8]", "train.fail_mode=kill"])
        overrides = section_overrides(cfg, "train")
        assert "train.chaos.mtbf_s=30" in overrides and "train.chaos.seed=0" in overrides
        again = compose("config", overrides)
    expected = OmegaConf.to_container(cfg.train, resolve=True)
    expected.pop("peak_flops")
    got = OmegaConf.to_container(again.train, resolve=True)
    got.pop("peak_flops")
    assert got == expected
