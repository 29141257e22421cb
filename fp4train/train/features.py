"""The features a run is made of (:mod:`fp4train.features`): the catalog of every method's features, and the
checks that refuse, before any work, a run one of them cannot do."""

from __future__ import annotations

from .. import recipes as _recipes
from ..adahop.training import AdaHOPCalibration
from ..features import Feature
from ..linear.lora_svd_realignment import LoRASVDRealignment
from .config import TrainConfig

#: every feature a recipe can ask for, in the order their hooks run; each says for itself whether a run needs it
CATALOG: tuple[type[Feature], ...] = (LoRASVDRealignment, AdaHOPCalibration)


def recipe_and_features(cfg: TrainConfig, extra=()) -> tuple[_recipes.Recipe, list[Feature]]:
    """The run's recipe and the features it needs, then ``extra`` (features given by the caller), after each
    feature has refused what cannot work (e.g. AdaHOP that would never leave its BF16 calibration)."""
    recipe = _recipes.get(cfg.recipe)
    features = [f for cls in CATALOG if (f := cls.for_run(recipe, cfg)) is not None]
    for f in extra:
        if not isinstance(f, Feature):
            raise TypeError(f"features: {f!r} is not a fp4train.features.Feature")
    return recipe, features + list(extra)


def summary_defaults() -> dict:
    """The summary keys of every feature in the catalog, as a run without the feature reports them."""
    out: dict = {}
    for cls in CATALOG:
        out.update(cls.SUMMARY)
    return out
