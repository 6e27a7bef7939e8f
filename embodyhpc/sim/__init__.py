"""Simulators: environments, camera renderers and scripted experts (MetaWorld today).

Evaluation suites (embodyhpc.eval) roll policies out in them; `embodyhpc data synth` records expert
demonstrations from them as datasets (through embodyhpc.data.writer). Importing this package imports no simulator.
"""
