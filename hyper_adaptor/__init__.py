"""hyper_adaptor: accelerator-portable features for Megatron, enabled by one import.

``import hyper_adaptor`` alone does not import megatron; ``import hyper_adaptor.megatron_adaptor``
is the one line a pretrain script adds. Frameworks that build Megatron's arguments themselves call
:func:`adapt` with that namespace instead.
"""

__version__ = "0.1.0"


def adapt(args):
    """Validate ``args`` against the registered features and apply the selected patches.

    Safe to call more than once: features already applied stay applied, nothing is patched twice.
    """
    from hyper_adaptor import megatron_adaptor

    return megatron_adaptor.adapt(args)
