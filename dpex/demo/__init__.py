"""The demo: train a small CNN on PNG images decoded and augmented by Dpex workers."""
