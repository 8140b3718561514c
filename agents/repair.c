// trimlab receive repair: tc ingress program (clsact, direct action) on a NIC host's data
// interface. Real switches cut a trimmed packet but leave its IP and UDP lengths and
// checksums as they were, and the host kernel drops it before any socket. For trimlab
// gradient datagrams only (UDP destination REPAIR_PORT, the trimlab header's magic and
// version), and only when everything that is stale is consistent with one packet cut
// short, this sets the lengths from the frame, recomputes the IPv4 header checksum and
// the UDP checksum, and counts it. Anything else passes untouched; a frame that claims to
// be trimmed but is inconsistent is counted and left for the kernel to drop.
//
// tc ingress rather than XDP: it runs after the packet taps, so a capture on the host
// keeps the frame as the switch sent it (the trim's evidence), and on every driver.
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "bpf_csum.h"

#ifndef REPAIR_PORT
#define REPAIR_PORT 47000
#endif
#define HDR_LEN 24  // the trimlab header (trimlab.wire.HEADER_LEN)
#define HDR_LENGTH_OFF 18  // its `length`: UDP payload bytes as sent

enum { C_SEEN, C_REPAIRED, C_REFUSED, C_N };

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, C_N);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

static __always_inline int bump(__u32 which)
{
	__u64 *c = bpf_map_lookup_elem(&counters, &which);
	if (c)
		__sync_fetch_and_add(c, 1);
	return TC_ACT_OK;
}

SEC("tc")
int trimlab_repair(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return TC_ACT_OK;
	__u16 proto = bpf_ntohs(eth->h_proto);
	__u32 l3 = sizeof(*eth), l4, claimed_ip, ipv6 = 0;
	__u8 iph[40];
	if (proto == ETH_P_IP) {
		if (bpf_skb_load_bytes(skb, l3, iph, 20) < 0)
			return TC_ACT_OK;
		if (iph[0] != 0x45 || iph[9] != IPPROTO_UDP)  // trimlab sends no IP options
			return TC_ACT_OK;
		if ((iph[6] & 0x3f) || iph[7])  // a fragment (MF or an offset): not one datagram
			return TC_ACT_OK;
		l4 = l3 + 20;
		claimed_ip = (iph[2] << 8 | iph[3]);
	} else if (proto == ETH_P_IPV6) {
		if (bpf_skb_load_bytes(skb, l3, iph, 40) < 0)
			return TC_ACT_OK;
		if ((iph[0] >> 4) != 6 || iph[6] != IPPROTO_UDP)
			return TC_ACT_OK;
		l4 = l3 + 40;
		claimed_ip = 40 + (iph[4] << 8 | iph[5]);
		ipv6 = 1;
	} else {
		return TC_ACT_OK;
	}
	__u8 udp[8 + HDR_LEN];
	if (bpf_skb_load_bytes(skb, l4, udp, 8) < 0)
		return TC_ACT_OK;
	if ((udp[2] << 8 | udp[3]) != REPAIR_PORT)
		return TC_ACT_OK;
	bump(C_SEEN);
	__u32 len = skb->len;
	if (len < l4 + 8 + HDR_LEN || len - l3 > 0xffff)
		return TC_ACT_OK;  // no whole trimlab header: not ours to judge
	if (bpf_skb_load_bytes(skb, l4, udp, sizeof(udp)) < 0)
		return TC_ACT_OK;
	if (udp[8] != 0xA1)  // magic 0xA, version 1
		return TC_ACT_OK;
	__u32 actual_udp = len - l4, actual_ip = len - l3;
	__u32 sent_udp = 8 + (udp[8 + HDR_LENGTH_OFF] << 8 | udp[8 + HDR_LENGTH_OFF + 1]);
	if (sent_udp <= actual_udp)
		return TC_ACT_OK;  // not cut (or padded): the kernel judges it as it is
	// Cut short: every length must be either the frame's (rewritten by the switch) or the
	// datagram's as sent (stale), and an IPv4 header checksum must hold for the header as
	// it was, up to the DSCP a trimming switch remarks; else it is not a trimmed packet.
	__u32 udp_len = udp[4] << 8 | udp[5];
	__u32 sent_ip = (l4 - l3) + sent_udp;
	if ((claimed_ip != actual_ip && claimed_ip != sent_ip) || (udp_len != actual_udp && udp_len != sent_udp))
		return bump(C_REFUSED);
	if (!ipv6) {
		// The header as it is, and with its DSCP cleared: a sent header with DSCP d sums
		// to the latter plus 4d in the tos byte (the high byte here: sums are over
		// little-endian loads of network-order words).
		__u64 now = bpf_csum_diff(0, 0, (__be32 *)iph, 20, 0);
		iph[1] &= 3;
		__u16 missing = 0xffff - fold(bpf_csum_diff(0, 0, (__be32 *)iph, 20, 0));
		int valid_now = fold(now) == 0xffff;
		int valid_before_remark = (missing & 0xff) == 0 && (missing >> 8) % 4 == 0;
		if (claimed_ip == sent_ip ? !valid_before_remark : !valid_now)
			return bump(C_REFUSED);
		__be16 tot = bpf_htons(actual_ip);
		bpf_skb_store_bytes(skb, l3 + 2, &tot, 2, 0);
		__u16 zero16 = 0;
		bpf_skb_store_bytes(skb, l3 + 10, &zero16, 2, 0);
		__u16 csum = ~fold(sum_bytes(skb, l3, 20));
		bpf_skb_store_bytes(skb, l3 + 10, &csum, 2, 0);
	} else {
		__be16 plen = bpf_htons(actual_ip - 40);
		bpf_skb_store_bytes(skb, l3 + 4, &plen, 2, 0);
	}
	__be16 ulen = bpf_htons(actual_udp);
	bpf_skb_store_bytes(skb, l4 + 4, &ulen, 2, 0);
	__u16 zero16 = 0;
	bpf_skb_store_bytes(skb, l4 + 6, &zero16, 2, 0);
	__u64 s = sum_bytes(skb, l3 + (ipv6 ? 8 : 12), ipv6 ? 32 : 8);  // pseudo header
	s += bpf_htons(IPPROTO_UDP) + bpf_htons(actual_udp);
	s += sum_bytes(skb, l4, actual_udp);
	__u16 csum = ~fold(s);
	if (csum == 0)
		csum = 0xffff;
	bpf_skb_store_bytes(skb, l4 + 6, &csum, 2, 0);
	return bump(C_REPAIRED);
}

char _license[] SEC("license") = "GPL";
