"""Features by dataset index: a frozen backbone's outputs over a dataset, stored once.

:func:`~.extract.extract_features` runs the backbone over the dataset in batches and
returns a :class:`~.dataset.FeatureDataset` that reads rows of one fixed-stride file
(:mod:`torchcache.stores.features`).
"""

from .backbone import MissingFeatureError
from .dataset import FeatureDataset
from .extract import extract_features

__all__ = ["FeatureDataset", "MissingFeatureError", "extract_features"]
