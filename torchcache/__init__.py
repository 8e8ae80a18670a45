"""torchcache: cache the per-item outputs of frozen PyTorch modules and functions.

>>> import torch
>>> from torchcache import torchcache
>>> @torchcache()
... class Frozen(torch.nn.Module):
...     def __init__(self) -> None:
...         super().__init__()
...         self.linear = torch.nn.Linear(4, 2).requires_grad_(False)
...     def forward(self, x: torch.Tensor) -> torch.Tensor:
...         return self.linear(x)
>>> model = Frozen()
>>> x = torch.randn(8, 4)
>>> torch.equal(model(x), model(x))
True
>>> model.cache_instance.stats().hits
8
"""

from ._log import configure_from_env, set_logger_config
from ._version import __version__
from .catalog.budget import set_root_budget
from .datasets.cache import SampleCache
from .datasets.dataset import CachedDataset, MissingSampleError
from .datasets.sampler import WindowSampler
from .errors import CacheWarning, ConfigError, CorruptEntryError, KeyingError, StoreError, TorchCacheError
from .features import FeatureDataset, MissingFeatureError, extract_features
from .module.decorator import torchcache
from .module.precompute import precompute
from .stats import CacheStats, TierStats
from .tiers.writer import flush_all

__all__ = [
    "CacheStats",
    "CacheWarning",
    "CachedDataset",
    "ConfigError",
    "CorruptEntryError",
    "FeatureDataset",
    "KeyingError",
    "MissingFeatureError",
    "MissingSampleError",
    "SampleCache",
    "StoreError",
    "TierStats",
    "TorchCacheError",
    "WindowSampler",
    "__version__",
    "extract_features",
    "flush_all",
    "precompute",
    "set_logger_config",
    "set_root_budget",
    "torchcache",
]

configure_from_env()
