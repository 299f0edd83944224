// SPDX-License-Identifier: GPL-2.0
/*
 * tenon_gate: a sched_ext scheduler that holds the tasks of denied sandbox cgroups.
 *
 * The controller writes `gate[cgroup id] = 1` (deny) or deletes the entry (allow); the id is
 * the cgroup directory's inode number on cgroup v2. A task is denied when its v2 cgroup or any
 * ancestor is denied. A denied task that becomes runnable waits in WAIT_DSQ; every other task
 * goes through one global FIFO (SHARED_DSQ), as in the kernel's scx_simple. ops.dispatch moves
 * tasks that are no longer denied out of WAIT_DSQ, and a timer kicks idle CPUs while anything
 * waits, so an allow takes effect without another wakeup on the host.
 *
 * Full switch (every SCHED_NORMAL task), not SCX_OPS_SWITCH_PARTIAL: a sandbox's processes are
 * ordinary SCHED_NORMAL tasks the controller does not create, and partial mode would require
 * each of them to call sched_setattr(SCHED_EXT) first, which a command inside a sandbox can undo.
 *
 * A task that is exiting or has SIGKILL pending is never held: killing a denied sandbox
 * (cgroup.kill, the runtime's kill and remove) must complete without an allow first.
 *
 * The kernel's watchdog ejects the scheduler when a runnable task has not run for timeout_ms,
 * so a hold must end (or become a cgroup freeze, which makes the tasks sleep) before that; the
 * loader's caller escalates long holds to the freezer.
 */
#define BPF_NO_KFUNC_PROTOTYPES
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_tracing.h>

char _license[] SEC("license") = "GPL";

#define SHARED_DSQ 0
#define WAIT_DSQ 1
#define MAX_CGROUP_DEPTH 16 /* deeper ancestors than this are not consulted */
#define WAIT_KICK_NS (5ULL * 1000 * 1000)
#define PF_EXITING_FLAG 0x00000004
#define SIGKILL_BIT (1UL << (9 - 1))
#define CLOCK_MONOTONIC_ID 1

#define BPF_STRUCT_OPS(name, args...) SEC("struct_ops/" #name) BPF_PROG(name, ##args)
#define BPF_STRUCT_OPS_SLEEPABLE(name, args...) SEC("struct_ops.s/" #name) BPF_PROG(name, ##args)
#define BPF_FOR_EACH_ITER (&___it) /* the iterator bpf_for_each declares */

extern s32 scx_bpf_create_dsq(u64 dsq_id, s32 node) __ksym;
extern void scx_bpf_dsq_insert(struct task_struct *p, u64 dsq_id, u64 slice, u64 enq_flags) __ksym;
extern bool scx_bpf_dsq_move_to_local(u64 dsq_id) __ksym;
extern bool scx_bpf_dsq_move(struct bpf_iter_scx_dsq *it__iter, struct task_struct *p,
			     u64 dsq_id, u64 enq_flags) __ksym;
extern s32 scx_bpf_dsq_nr_queued(u64 dsq_id) __ksym;
extern s32 scx_bpf_select_cpu_dfl(struct task_struct *p, s32 prev_cpu, u64 wake_flags,
				  bool *is_idle) __ksym;
extern void scx_bpf_kick_cpu(s32 cpu, u64 flags) __ksym;
extern u32 scx_bpf_nr_cpu_ids(void) __ksym;
extern bool scx_bpf_task_set_slice(struct task_struct *p, u64 slice) __ksym;
extern int bpf_iter_scx_dsq_new(struct bpf_iter_scx_dsq *it, u64 dsq_id, u64 flags) __ksym;
extern struct task_struct *bpf_iter_scx_dsq_next(struct bpf_iter_scx_dsq *it) __ksym;
extern void bpf_iter_scx_dsq_destroy(struct bpf_iter_scx_dsq *it) __ksym;
extern void *bpf_rdonly_cast(const void *obj__ign, u32 btf_id__k) __ksym;

/* cgroup id -> 1 (deny). Absent or 0 means allowed. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, u64);
	__type(value, u8);
} gate SEC(".maps");

enum gate_stat {
	STAT_HELD,	/* enqueues into WAIT_DSQ */
	STAT_RELEASED,	/* moves out of WAIT_DSQ because the task is allowed again */
	STAT_SPARED,	/* denied tasks let through because they are exiting or being killed */
	STAT_PREEMPTED, /* running tasks whose slice was cut when their cgroup got denied */
	STAT_DISPATCHED, /* enqueues into SHARED_DSQ or a local DSQ */
	NUM_STATS,
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, NUM_STATS);
	__type(key, u32);
	__type(value, u64);
} gate_stats SEC(".maps");

struct kick_timer {
	struct bpf_timer timer;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, u32);
	__type(value, struct kick_timer);
} kick_timer SEC(".maps");

static void count(u32 stat)
{
	u64 *value = bpf_map_lookup_elem(&gate_stats, &stat);

	if (value)
		__sync_fetch_and_add(value, 1);
}

static bool dying(const struct task_struct *p)
{
	return (p->flags & PF_EXITING_FLAG) || (p->pending.signal.sig[0] & SIGKILL_BIT);
}

static bool cgroup_denied(struct task_struct *p)
{
	struct cgroup *cgrp;
	int depth;

	cgrp = bpf_rdonly_cast(p->cgroups->dfl_cgrp, bpf_core_type_id_kernel(struct cgroup));
	for (depth = 0; depth < MAX_CGROUP_DEPTH; depth++) {
		struct cgroup_subsys_state *parent;
		u64 id;
		u8 *deny;

		if (!cgrp)
			return false;
		id = cgrp->kn->id;
		deny = bpf_map_lookup_elem(&gate, &id);
		if (deny && *deny)
			return true;
		/* `self` is struct cgroup's first member: a parent css is its cgroup. */
		parent = cgrp->self.parent;
		if (!parent)
			return false;
		cgrp = bpf_rdonly_cast(parent, bpf_core_type_id_kernel(struct cgroup));
	}
	return false;
}

static bool held(struct task_struct *p)
{
	if (!cgroup_denied(p))
		return false;
	if (dying(p)) {
		count(STAT_SPARED);
		return false;
	}
	return true;
}

static int kick_waiting(void *map, int *key, struct kick_timer *value)
{
	u32 cpu, num_cpus;

	if (scx_bpf_dsq_nr_queued(WAIT_DSQ) <= 0)
		return 0;
	/* An idle CPU runs ops.dispatch when kicked, which re-checks every waiting task. */
	num_cpus = scx_bpf_nr_cpu_ids();
	bpf_for(cpu, 0, num_cpus)
		scx_bpf_kick_cpu(cpu, SCX_KICK_IDLE);
	bpf_timer_start(&value->timer, WAIT_KICK_NS, 0);
	return 0;
}

static void arm_kick_timer(void)
{
	u32 key = 0;
	struct kick_timer *value = bpf_map_lookup_elem(&kick_timer, &key);

	/* Fails harmlessly (-EBUSY is not returned; a pending timer is simply re-armed). */
	if (value)
		bpf_timer_start(&value->timer, WAIT_KICK_NS, 0);
}

s32 BPF_STRUCT_OPS(gate_select_cpu, struct task_struct *p, s32 prev_cpu, u64 wake_flags)
{
	bool is_idle = false;
	s32 cpu;

	cpu = scx_bpf_select_cpu_dfl(p, prev_cpu, wake_flags, &is_idle);
	if (is_idle && !held(p)) {
		count(STAT_DISPATCHED);
		scx_bpf_dsq_insert(p, SCX_DSQ_LOCAL, SCX_SLICE_DFL, 0);
	}
	return cpu;
}

void BPF_STRUCT_OPS(gate_enqueue, struct task_struct *p, u64 enq_flags)
{
	if (held(p)) {
		count(STAT_HELD);
		scx_bpf_dsq_insert(p, WAIT_DSQ, SCX_SLICE_DFL, enq_flags);
		arm_kick_timer();
		return;
	}
	count(STAT_DISPATCHED);
	scx_bpf_dsq_insert(p, SHARED_DSQ, SCX_SLICE_DFL, enq_flags);
}

void BPF_STRUCT_OPS(gate_dispatch, s32 cpu, struct task_struct *prev)
{
	struct task_struct *p;

	if (scx_bpf_dsq_nr_queued(WAIT_DSQ) > 0) {
		bpf_for_each(scx_dsq, p, WAIT_DSQ, 0) {
			if (held(p))
				continue;
			if (scx_bpf_dsq_move(BPF_FOR_EACH_ITER, p, SHARED_DSQ, 0))
				count(STAT_RELEASED);
		}
	}
	scx_bpf_dsq_move_to_local(SHARED_DSQ);
}

void BPF_STRUCT_OPS(gate_tick, struct task_struct *p)
{
	/* A task that was running when its cgroup got denied stops at the next tick. */
	if (held(p)) {
		count(STAT_PREEMPTED);
		scx_bpf_task_set_slice(p, 0);
	}
}

s32 BPF_STRUCT_OPS_SLEEPABLE(gate_init)
{
	u32 key = 0;
	struct kick_timer *value;
	s32 err;

	err = scx_bpf_create_dsq(SHARED_DSQ, -1);
	if (err)
		return err;
	err = scx_bpf_create_dsq(WAIT_DSQ, -1);
	if (err)
		return err;
	value = bpf_map_lookup_elem(&kick_timer, &key);
	if (!value)
		return -2; /* -ENOENT */
	bpf_timer_init(&value->timer, &kick_timer, CLOCK_MONOTONIC_ID);
	bpf_timer_set_callback(&value->timer, kick_waiting);
	return 0;
}

void BPF_STRUCT_OPS(gate_exit, struct scx_exit_info *ei)
{
}

SEC(".struct_ops.link")
struct sched_ext_ops tenon_gate_ops = {
	.select_cpu = (void *)gate_select_cpu,
	.enqueue = (void *)gate_enqueue,
	.dispatch = (void *)gate_dispatch,
	.tick = (void *)gate_tick,
	.init = (void *)gate_init,
	.exit = (void *)gate_exit,
	/*
	 * Without ENQ_LAST the kernel keeps a CPU's only runnable task running when its slice
	 * ends, without asking ops.enqueue: a denied task alone on its CPU would never stop.
	 */
	.flags = SCX_OPS_ENQ_LAST,
	/* The most the kernel accepts (SCX_WATCHDOG_MAX_TIMEOUT, 30 s). */
	.timeout_ms = 30000,
	.name = "tenon_gate",
};
