"""The Tessera DRA driver (``tessera-dra``): GPU shares as consumable capacity (docs/dra.md)."""
