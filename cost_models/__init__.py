"""What things cost: model and cluster specs, compute/communication/memory cost functions."""
from .base import LayerCosts, PerLayerCostModel, StageCosts, UnitCostModel, partition_layers
from .model_spec import ModelSpec, SpecError, load_model, model_presets
from .network import Link, Network, PortNetwork
