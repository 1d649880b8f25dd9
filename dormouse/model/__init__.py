"""The network: `DormouseModel(ModelConfig)`. See network.py for its shape."""

from dormouse.model.network import DormouseModel

__all__ = ["DormouseModel"]
