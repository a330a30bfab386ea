"""DeepLabV3 / V3+ networks with synchronized BatchNorm.

Import what you need from its module (`syncseg.model.builder.build_model`, `syncseg.model.sync_batchnorm`, ...): this
package file imports nothing, so `syncseg.model.sync_batchnorm` stays usable on its own (torch only).
"""
