"""The executable specification of ddtree: numpy reference model and DDTree algorithm."""

from ddtree.reference.mla import KVCache
from ddtree.reference.model import ForwardOutput, ReferenceModel
from ddtree.reference.generate import generate

__all__ = ["ForwardOutput", "KVCache", "ReferenceModel", "generate"]
