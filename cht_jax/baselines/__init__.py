"""The math of the Table 1 baselines that learn the task sequence by gradient descent.

  sequential.py  the K*T head, theta_t = update(theta_{t-1}, S(t)) as one scan, the accuracies
  ewc.py         EWC's penalty and diagonal Fisher
  rules.py       the update rules of fine-tuning and EWC
  pretrain.py    the network pretrained on the training classes, and its fresh K*T head
  maml.py        MAML++: meta-learned init, per-layer per-step inner learning rates, meta-loss

The methods built on them (training, evaluation) are in cht_jax/methods/.
"""
