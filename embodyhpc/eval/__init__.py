"""Simulation evaluation: suites, policies, rollouts, shard planning, aggregation, plots.

    shards     plan_shards / all_episodes: the (task, seed, episode) grid split into array shards
    suites     make_suite(name, tasks, cameras=, image_size=) -> Suite; register_suite for a site's simulator
    policies   Policy protocol (reset(task, seed), act(obs)); ExpertPolicy, RandomPolicy
    references the reference-policy registry (eval.reference_policies, data synth --policy)
    trained    load_trained_policy(export): any model's exported weights -> its spec's inference
    rollout    run_episode, run_shard (one JSONL record per episode, written atomically; mp4 videos)
    aggregate  wilson_interval, aggregate(records, planned) -> Report, format_table, markdown_summary
    plots      plot_task_bars, plot_success_vs_step (matplotlib, imported when drawn)

Nothing here imports torch or a simulator at import time: simulators load when a suite is made.
"""
