// trimlab virtual switch: tc egress program on every switch port (clsact, direct action).
//
// SONiC/SAI packet-trimming semantics. DSCP -> queue; per (port, queue) a virtual queue
// of `budget` bytes drained at the port rate decides admission (like NDP on Tofino, which
// under-approximates occupancy with a meter); HTB strict-priority bands under the port
// rate do the real scheduling (skb->priority = 1:(10 + band), band 0 first, band = 7 - queue).
// Admission fails on a `trim` queue: the packet is cut to `size` bytes from the Ethernet
// header, its DSCP set to the port's trimmed-packet DSCP (`dscp_value`, or with from-tc the
// port's TC_TO_DSCP map of the trim TC; ECN kept), and it is sent on `queue_index` (own
// budget; over it: dropped, counted). Which lengths and checksums are rewritten after the
// cut is the emulated platform's (`flags`): real ASICs leave them stale. A trim-once
// platform (Ultra Ethernet) never trims a packet that carries a trimmed-packet DSCP.
// On a `drop` queue it is dropped. Deterministic injection trims/drops an eligible packet
// when a hash of its identity falls under p, whatever the occupancy.
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "bpf_csum.h"

#define NQ 8
#define MAX_PORTS 64
#define MAX_IFINDEX 4096
#define ACT_DROP 0
#define ACT_TRIM 1
#define TRIMLAB_PORT 47000
#define MAX_L4 9216
#define F_IP_LEN 1      // rewrite the IPv4 total length / IPv6 payload length
#define F_IP_CSUM 2     // recompute the IPv4 header checksum
#define F_UDP_LEN 4     // rewrite the UDP length
#define F_L4_CSUM 8     // recompute the UDP/TCP checksum
#define F_TRIM_ONCE 16  // a packet with a trimmed-packet DSCP is never trimmed again

struct qstate {
	struct bpf_spin_lock lock;
	__u32 pad;
	__u64 occ;      // virtual queue occupancy, bytes
	__u64 last_ns;  // when occ was last drained
	__u64 peak;     // peak occupancy, bytes
	__u64 tx_pkts;
	__u64 tx_bytes;
	__u64 trim_pkts;      // packets that hit the trim action on this queue
	__u64 trim_tx_pkts;   // ... and were sent trimmed
	__u64 trim_drp_pkts;  // ... and were dropped: the trim queue was full too
	__u64 drop_pkts;      // dropped by a drop queue (or non-IP over budget)
};

struct gcfg {
	__u32 enabled;
	__u32 size;         // trim size, bytes from the Ethernet header
	__u32 dscp_value;   // DSCP of trimmed packets (from-tc: each port's trim_dscp)
	__u32 queue_index;  // queue of trimmed packets
	__u32 inject_p;     // injection probability × 2^32 (0: off)
	__u32 inject_action;
	__u32 inject_seed;
	__u32 from_tc;      // control plane only: from-tc's trim TC + 1 (0: dscp_value for every port)
	__u32 flags;        // F_*: the emulated platform
	__u32 platform;     // control plane only: the platform's catalog index
	__u32 inject_queues;  // bit q: injection reaches queue q (0: every queue whose action is trim)
	__u32 pad;
	__u64 trimmed_dscps;  // bit d: DSCP d marks trimmed packets (F_TRIM_ONCE)
};

struct portcfg {
	__u64 rate;  // bytes per second
	__u32 budget[NQ];
	__u8 action[NQ];
	__u8 trim_dscp;  // DSCP of packets trimmed leaving this port
	__u8 routed;     // the far end is a Linux router (a virtual fabric's next hop)
	__u8 pad[6];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_PORTS * NQ);
	__type(key, __u32);
	__type(value, struct qstate);
} queues SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct gcfg);
} config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_PORTS);
	__type(key, __u32);
	__type(value, struct portcfg);
} ports SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 64);
	__type(key, __u32);
	__type(value, __u32);
} dscp_queue SEC(".maps");

// ifindex -> port number + 1 (0: not a switch port). An array, not a hash: this lookup
// runs for every packet, and ifindexes inside the switch namespace are small.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_IFINDEX);
	__type(key, __u32);
	__type(value, __u32);
} port_of SEC(".maps");

// HTB class 1:(0x10 + band) of a queue; higher queues are served first.
static __always_inline __u32 band_class(__u32 queue)
{
	return (1 << 16) | (0x10 + NQ - 1 - queue);
}

static __always_inline __u32 mix32(__u32 h, __u32 v)
{
	v *= 0xcc9e2d51;
	v = (v << 15) | (v >> 17);
	v *= 0x1b873593;
	h ^= v;
	h = (h << 13) | (h >> 19);
	return h * 5 + 0xe6546b64;
}

static __always_inline __u32 fmix32(__u32 h)
{
	h ^= h >> 16;
	h *= 0x85ebca6b;
	h ^= h >> 13;
	h *= 0xc2b2ae35;
	return h ^ (h >> 16);
}

// Drain the virtual queue to now; admit `len` bytes if they fit the budget.
static __always_inline int admit(struct qstate *q, __u64 rate, __u32 budget, __u32 len, __u64 now)
{
	int ok;
	bpf_spin_lock(&q->lock);
	__u64 elapsed = now - q->last_ns;
	if (elapsed > 1000000000ULL) {
		q->occ = 0;
	} else {
		__u64 drained = elapsed * rate / 1000000000ULL;
		q->occ = q->occ > drained ? q->occ - drained : 0;
	}
	q->last_ns = now;
	ok = q->occ + len <= budget;
	if (ok) {
		q->occ += len;
		if (q->occ > q->peak)
			q->peak = q->occ;
		q->tx_pkts++;
		q->tx_bytes += len;
	}
	bpf_spin_unlock(&q->lock);
	return ok;
}

static __always_inline void count(struct qstate *q, int field)
{
	bpf_spin_lock(&q->lock);
	if (field == 0) q->trim_pkts++;
	else if (field == 1) q->trim_tx_pkts++;
	else if (field == 2) q->trim_drp_pkts++;
	else q->drop_pkts++;
	bpf_spin_unlock(&q->lock);
}

SEC("tc")
int trimlab_egress(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct gcfg *cfg = bpf_map_lookup_elem(&config, &zero);
	__u32 ifindex = skb->ifindex;
	__u32 *portp = bpf_map_lookup_elem(&port_of, &ifindex);
	if (!cfg || !portp || !*portp || !cfg->enabled)
		return TC_ACT_OK;
	__u32 port = *portp - 1;
	if (port >= MAX_PORTS)
		return TC_ACT_OK;
	struct portcfg *pc = bpf_map_lookup_elem(&ports, &port);
	if (!pc)
		return TC_ACT_OK;

	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return TC_ACT_OK;
	__u16 proto = bpf_ntohs(eth->h_proto);
	__u32 l3 = sizeof(*eth), l4 = 0, dscp = 0, ipv6 = 0;
	__u8 l4proto = 0;
	if (proto == ETH_P_IP) {
		struct iphdr *ip = data + l3;
		if ((void *)(ip + 1) > end)
			return TC_ACT_OK;
		dscp = ip->tos >> 2;
		l4proto = ip->protocol;
		l4 = l3 + ip->ihl * 4;
	} else if (proto == ETH_P_IPV6) {
		struct ipv6hdr *ip6 = data + l3;
		if ((void *)(ip6 + 1) > end)
			return TC_ACT_OK;
		dscp = ((ip6->priority << 4) | (ip6->flow_lbl[0] >> 4)) >> 2;
		l4proto = ip6->nexthdr;
		l4 = l3 + sizeof(*ip6);
		ipv6 = 1;
	} else {
		return TC_ACT_OK;  // ARP, LLDP...: control traffic is never trimmed
	}
	__u32 *qp = bpf_map_lookup_elem(&dscp_queue, &dscp);
	__u32 queue = qp ? *qp & (NQ - 1) : 0;
	__u32 key = port * NQ + queue;
	struct qstate *q = bpf_map_lookup_elem(&queues, &key);
	if (!q)
		return TC_ACT_OK;
	__u64 now = bpf_ktime_get_ns();
	__u32 len = skb->len;
	__u8 action = pc->action[queue];
	int trimmed_once = (cfg->flags & F_TRIM_ONCE) && ((cfg->trimmed_dscps >> dscp) & 1);
	if (trimmed_once)
		action = ACT_DROP;

	int forced = 0;
	if (cfg->inject_p) {
		__u32 h = cfg->inject_seed;
		__u8 id[20];
		__builtin_memset(id, 0, sizeof(id));
		struct udphdr *udp = data + l4;
		if (l4proto == IPPROTO_UDP && (void *)(udp + 1) <= end &&
		    bpf_ntohs(udp->dest) == TRIMLAB_PORT &&
		    bpf_skb_load_bytes(skb, l4 + 8, id, 20) == 0 && (id[0] >> 4) == 0xA) {
			// trimlab header: packet index (byte 3) through span (bytes 4..15)
			h = mix32(h, ((__u32)id[3]));
			for (int i = 4; i < 16; i += 4)
				h = mix32(h, *(__u32 *)&id[i]);
		} else {
			__u32 n = ipv6 ? 40 : 20;
			if (bpf_skb_load_bytes(skb, l3 + (ipv6 ? 8 : 4), id, 4) == 0)  // v4: id/frag
				h = mix32(h, *(__u32 *)id);
			if (bpf_skb_load_bytes(skb, l3 + (ipv6 ? 8 : 12), id, 8) == 0)  // addresses
				h = mix32(mix32(h, *(__u32 *)id), *(__u32 *)&id[4]);
			if (bpf_skb_load_bytes(skb, l3 + n, id, 8) == 0)  // ports + next 4 bytes
				h = mix32(mix32(h, *(__u32 *)id), *(__u32 *)&id[4]);
		}
		// a packet a trim-once platform already trimmed is never trimmed again, forced or not
		int reaches = !trimmed_once &&
			      (cfg->inject_queues ? (cfg->inject_queues >> queue) & 1 : action == ACT_TRIM);
		if (fmix32(h) < cfg->inject_p && reaches)
			forced = 1;
	}

	if (!forced && admit(q, pc->rate, pc->budget[queue], len, now)) {
		skb->priority = band_class(queue);
		return TC_ACT_OK;
	}
	int do_trim = forced ? cfg->inject_action == ACT_TRIM : action == ACT_TRIM;
	if (!do_trim) {
		count(q, 3);
		return TC_ACT_SHOT;
	}
	count(q, 0);

	// Trim: cut, remark, fix lengths and checksums.
	__u32 size = cfg->size;
	if (len > size) {
		if (bpf_skb_change_tail(skb, size, 0) < 0) {
			count(q, 2);
			return TC_ACT_SHOT;
		}
		len = size;
	}
	__u32 l4len = len > l4 ? len - l4 : 0;
	__u32 flags = cfg->flags;
	// A Linux router drops a packet whose IP length exceeds its frame, where an ASIC
	// forwards it: towards one, the IP header is made whole (the UDP fields stay as the
	// platform leaves them, for the receiving host to repair).
	if (pc->routed)
		flags |= F_IP_LEN | F_IP_CSUM;
	if (ipv6) {
		__u8 hdr[2];
		if (bpf_skb_load_bytes(skb, l3, hdr, 2) < 0)
			return TC_ACT_SHOT;
		__u8 tclass = ((pc->trim_dscp & 63) << 2) | (((hdr[0] & 0x0f) << 4 | hdr[1] >> 4) & 3);
		hdr[0] = 0x60 | (tclass >> 4);
		hdr[1] = (tclass << 4) | (hdr[1] & 0x0f);
		bpf_skb_store_bytes(skb, l3, hdr, 2, 0);
		if (flags & F_IP_LEN) {
			__be16 plen = bpf_htons(l4len);
			bpf_skb_store_bytes(skb, l3 + 4, &plen, 2, 0);
		}
	} else {
		__u8 tos;
		if (bpf_skb_load_bytes(skb, l3 + 1, &tos, 1) < 0)
			return TC_ACT_SHOT;
		tos = ((pc->trim_dscp & 63) << 2) | (tos & 3);
		bpf_skb_store_bytes(skb, l3 + 1, &tos, 1, 0);
		if (flags & F_IP_LEN) {
			__be16 tot = bpf_htons(len - l3);
			bpf_skb_store_bytes(skb, l3 + 2, &tot, 2, 0);
		}
		if (flags & F_IP_CSUM) {
			__u16 zero16 = 0;
			bpf_skb_store_bytes(skb, l3 + 10, &zero16, 2, 0);
			__u16 csum = ~fold(sum_bytes(skb, l3, l4 - l3));
			bpf_skb_store_bytes(skb, l3 + 10, &csum, 2, 0);
		}
	}
	__u32 csum_off = 0;
	if (l4proto == IPPROTO_UDP && l4len >= 8) {
		if (flags & F_UDP_LEN) {
			__be16 ulen = bpf_htons(l4len);
			bpf_skb_store_bytes(skb, l4 + 4, &ulen, 2, 0);
		}
		csum_off = l4 + 6;
	} else if (l4proto == IPPROTO_TCP && l4len >= 20) {
		csum_off = l4 + 16;
	}
	if (csum_off && (flags & F_L4_CSUM)) {
		__u16 zero16 = 0;
		bpf_skb_store_bytes(skb, csum_off, &zero16, 2, 0);
		// pseudo header: addresses, protocol, L4 length
		__u64 s = sum_bytes(skb, l3 + (ipv6 ? 8 : 12), ipv6 ? 32 : 8);
		s += bpf_htons(l4proto) + bpf_htons(l4len);
		s += sum_bytes(skb, l4, l4len);
		__u16 csum = ~fold(s);
		if (csum == 0 && l4proto == IPPROTO_UDP)
			csum = 0xffff;
		bpf_skb_store_bytes(skb, csum_off, &csum, 2, 0);
	}

	__u32 tq = cfg->queue_index & (NQ - 1);
	__u32 tkey = port * NQ + tq;
	struct qstate *t = bpf_map_lookup_elem(&queues, &tkey);
	if (!t)
		return TC_ACT_SHOT;
	if (!admit(t, pc->rate, pc->budget[tq], len, now)) {
		count(q, 2);
		return TC_ACT_SHOT;
	}
	count(q, 1);
	skb->priority = band_class(tq);
	return TC_ACT_OK;
}

char _license[] SEC("license") = "GPL";
