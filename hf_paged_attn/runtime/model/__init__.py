"""The user's model as the engine holds it: marks, weights and their versions, adapters, devices, memory, sleep."""
