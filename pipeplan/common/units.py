"""Binary units: memory figures are bytes in the code and GiB / MiB (`_gib`, `_mib` keys) where people read them."""

GIB = 2**30  # bytes per GiB: scenario and preset `*_gib` keys, and every figure shown in GiB
MIB = 2**20  # bytes per MiB: preset `*_mib` keys
