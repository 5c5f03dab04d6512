"""What may be loaded and whether it fits: the models on this machine (catalog), the
operating system's memory readings (probe) and the gate that judges a load against them."""
