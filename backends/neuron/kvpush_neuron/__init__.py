"""kvpush backend for AWS Neuron (Trainium/Inferentia) devices.

Importing this package loads no device library: the Neuron runtime (libnrt)
is opened when a ``NeuronBackend`` is constructed, so ``kvpush`` can list
installed backends on any host.
"""

from kvpush_neuron.backend import Mode, NeuronBackend, ReadyMarker
from kvpush_neuron.layout import nxdi_bhsd_spec, nxdi_block_spec, nxdi_kv_caches, paged_spec
from kvpush_neuron.tensor import NeuronTensor

__all__ = [
    "Mode",
    "NeuronBackend",
    "NeuronTensor",
    "ReadyMarker",
    "nxdi_bhsd_spec",
    "nxdi_block_spec",
    "nxdi_kv_caches",
    "paged_spec",
]
