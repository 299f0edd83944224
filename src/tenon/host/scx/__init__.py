"""sched_ext gate actuator: the tenon_gate BPF scheduler, how to build and load it, and the
bpf(2) calls that set a cgroup's allow/deny in its map."""
