"""Tessera's node agent: the kubelet device plugin for GPU slices, inventory publisher and exporter."""
