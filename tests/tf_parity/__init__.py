"""TensorFlow's own `tf.distribute` strategy tests, translated to jaxstrategy: one module per TF file.

TF files are read from tensorflow/tensorflow, `tensorflow/python/distribute/`. Each test names the
TF file and test method it comes from; each module starts with the TF test classes and methods it
skips, and why. `combinations.py` stands in for TF's `strategy_combinations.py`, and
`two_process_worker.py` runs TF's two-process combinations as real two-process jobs.
"""
