"""What a unit does once, at construction, before it shards: check what it was given, give
meta-device modules real values, find its parameters under every name they have, group them
for sharding, keep grouped modules to their own unit, and pick the modules that compute in
float32."""
