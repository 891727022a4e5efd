"""An unadopted script (it never calls checkpointless.init()) that ends cleanly."""

print("trained without checkpointless")
