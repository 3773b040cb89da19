// The CPU kernels' options and path counters (cpu_options.h), and the ops that set and report
// them: set_cpu_options, cpu_isa, cpu_path_names, cpu_path_counts.
#include "cpu_options.h"

#include <c10/util/Exception.h>

#include <iterator>
#include <string>
#include <vector>

#include "../ops.h"
#include "amx_tile_ops.h"
#include "x86.h"

namespace cbatch {

std::atomic<bool> g_cpu_isa_avx2{false};
std::atomic<bool> g_cpu_attention_generic{false};
std::atomic<int> g_cpu_amx{static_cast<int>(AmxOption::kCpu)};
std::atomic<int64_t> g_cpu_path_counts[static_cast<int>(CpuPath::kCount)] = {};

namespace {

// In CpuPath's order.
constexpr const char* kCpuPathNames[] = {
    "linear.avx512",
    "linear.avx2",
    "linear.amx",
    "linear.bf16.avx2",
    "quantized_linear.w8.avx512",
    "quantized_linear.w8.avx2",
    "quantized_linear.w4.avx512",
    "quantized_linear.w4.avx2",
    "quantized_linear.w4.avx512bf16",
    "quantized_linear.w8a8.avx512vnni",
    "quantized_linear.w8a8.avx2",
    "quantized_linear.w8a8.amx",
    "quantized_linear.w4a8.avx512vnni",
    "quantized_linear.w4a8.avx2",
    "quantized_linear.w4a8.amx",
    "quantized_linear.w8a8g.avx2",
    "quantized_linear.w8a8g.avx512vnni",
    "greedy_head.int8.avx512vnni",
    "greedy_head.int8.avx2",
    "greedy_head.bf16.avx512",
    "greedy_head.bf16.avx2",
    "greedy_head.kernel",
    "greedy_head.unsettled_rows",
    "decode_attention.avx512",
    "decode_attention.avx512bf16",
    "decode_attention.avx2",
    "decode_attention.generic",
    "prefill_attention.avx512",
    "prefill_attention.avx512bf16",
    "prefill_attention.avx2",
    "prefill_attention.generic",
    "prefill_attention.transposed_rows",
    "argmax.avx512",
    "argmax.generic",
    "sample.avx512",
    "sample.avx2",
    "sample.generic",
    "penalties.cpu",
    "bitmask.cpu",
    "write_kv_cache.cpu",
    "rms_norm.avx2",
    "rms_norm.generic",
    "fused_add_rms_norm.avx2",
    "fused_add_rms_norm.generic",
    "silu_and_mul.avx2",
    "silu_and_mul.generic",
    "rotary_embedding.avx2",
    "rotary_embedding.generic",
    "decoder_layers.cpu",
    "gguf_unpack.cpu",
    "quantized_pack.cpu",
};
static_assert(std::size(kCpuPathNames) == static_cast<size_t>(CpuPath::kCount),
              "one name per CpuPath");

}  // namespace

void set_cpu_options(const std::string& isa, const std::string& attention,
                     const std::string& amx) {
  TORCH_CHECK_VALUE(isa.empty() || isa == "avx2",
                    "set_cpu_options: isa must be \"\" or \"avx2\", got \"", isa, "\"");
  TORCH_CHECK_VALUE(attention.empty() || attention == "generic",
                    "set_cpu_options: attention must be \"\" or \"generic\", got \"", attention,
                    "\"");
  TORCH_CHECK_VALUE(amx.empty() || amx == "off" || amx == "model",
                    "set_cpu_options: amx must be \"\", \"off\" or \"model\", got \"", amx,
                    "\"");
  g_cpu_isa_avx2.store(isa == "avx2", std::memory_order_relaxed);
  g_cpu_amx.store(static_cast<int>(amx == "off"     ? AmxOption::kOff
                                   : amx == "model" ? AmxOption::kModel
                                                    : AmxOption::kCpu),
                  std::memory_order_relaxed);
  g_cpu_attention_generic.store(attention == "generic", std::memory_order_relaxed);
}

std::string cpu_isa() {
  std::string out;
#ifdef CBATCH_X86
  const auto add = [&out](bool has, const char* name) {
    if (!has) return;
    if (!out.empty()) out += ' ';
    out += name;
  };
  add(cpu_has_avx512(), "avx512");
  add(cpu_has_avx512bf16(), "avx512bf16");
  add(cpu_has_avx512vnni(), "avx512vnni");
  add(amx::int8_tiles(), "amx-int8");
  add(cpu_has_avx2(), "avx2");
#endif
  return out;
}

std::vector<std::string> cpu_path_names() {
  return {std::begin(kCpuPathNames), std::end(kCpuPathNames)};
}

std::vector<int64_t> cpu_path_counts() {
  std::vector<int64_t> counts;
  for (const auto& count : g_cpu_path_counts) {
    counts.push_back(count.load(std::memory_order_relaxed));
  }
  return counts;
}

}  // namespace cbatch
