"""``unimp compare``: one recipe, the same model, weights and batches, in every framework.

Framework-free at import: each backend's runner is imported when it runs.
"""

from unimp.compare.data import Dataset, load_dataset
from unimp.compare.models import MODELS, init_weights

__all__ = ["MODELS", "Dataset", "init_weights", "load_dataset"]
