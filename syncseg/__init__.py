"""syncseg: DeepLabV3 / V3+ semantic segmentation with synchronized BatchNorm."""
