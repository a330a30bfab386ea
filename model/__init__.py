"""DeepLabV3 / V3+ networks with synchronized BatchNorm.

Import what you need from its module (`model.builder.build_model`, `model.sync_batchnorm`, ...): this
package file imports nothing, so `model.sync_batchnorm` stays usable on its own (torch only).
"""
