from importlib.resources import files

import pytest
from omegaconf import OmegaConf

from specblock.evaluate.config import VerifierConfig

VERIFIER_YAMLS = sorted(
    p.name for p in files("specblock.configs").joinpath("verifier").iterdir() if p.name.endswith(".yaml")
)


@pytest.mark.parametrize("name", VERIFIER_YAMLS)
def test_every_verifier_yaml_validates_against_the_schema(name):
    raw = OmegaConf.load(str(files("specblock.configs").joinpath("verifier", name)))
    merged = OmegaConf.merge(OmegaConf.structured(VerifierConfig), raw)
    cfg = OmegaConf.to_object(merged)
    assert cfg.name == name.removesuffix(".yaml")


def test_schema_rejects_bad_values():
    with pytest.raises(ValueError, match="not one of"):
        VerifierConfig(name="nope")
    with pytest.raises(ValueError, match="single draft"):
        VerifierConfig(name="block", num_drafts=3)
