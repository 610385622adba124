"""How the engines (vLLM, SGLang) are spoken to: leg bodies and their answers.

Neutral ground shared by the data plane (which drives most legs) and the metaserver
(which sends the layerwise prefill leg from the control plane). It imports no plane.
"""
