"""Producing outputs from a trained model: xformer's own greedy and beam search (decode.py),
int8 dynamic quantization for decoding (quantize.py) and CTranslate2 as another engine
(ctranslate2_engine.py).
"""
