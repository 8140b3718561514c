// One's-complement sums for trimlab's tc programs (the virtual switch's trim, the hosts'
// receive repair): #included by each (trimlab.native.build hashes it with them).
#ifndef TRIMLAB_BPF_CSUM_H
#define TRIMLAB_BPF_CSUM_H
#ifndef MAX_L4
#define MAX_L4 9216
#endif

static __always_inline __u16 fold(__u64 s)
{
	s = (s & 0xffffffff) + (s >> 32);
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u16)s;
}

// One's-complement sum of `len` bytes at packet offset `off`. A global function, so the
// verifier checks its loop once rather than at every call site.
__attribute__((noinline)) __u64 sum_bytes(struct __sk_buff *skb, __u32 off, __u32 len)
{
	__u64 s = 0;
	__u32 chunk;
	__u8 buf[64];
	for (int i = 0; i < MAX_L4 / 64 + 1; i++) {
		if (len == 0)
			break;
		chunk = len > 64 ? 64 : len;
		__builtin_memset(buf, 0, sizeof(buf));
		if (bpf_skb_load_bytes(skb, off, buf, chunk & 63 ? chunk & 63 : 64) < 0)
			return 0;
		__u32 words = (chunk + 3) / 4;  // zero padding beyond `chunk` adds nothing
		__s64 part = bpf_csum_diff(0, 0, (__be32 *)buf, words * 4 > 64 ? 64 : (words * 4) & ~3u, 0);
		s += (__u32)part;
		off += chunk;
		len -= chunk;
	}
	return s;
}

#endif
