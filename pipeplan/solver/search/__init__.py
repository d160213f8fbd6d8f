"""`pipeplan search`: the fastest configuration that fits N GPUs at a fixed global batch.

space.py enumerates the candidates as arrays, screen.py bounds every one at once from the cost model,
refine.py bounds one exactly from its cost table and simulates it, run.py orders and prunes (branch and bound).
"""
