#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const float* in_ptr0,
                       float* out_ptr0,
                       const int64_t ks0)
{
    std::atomic<int> inductor_cpu_integer_div_error{0};
    inductor_cpu_integer_div_error_flag = &inductor_cpu_integer_div_error;
    #pragma omp parallel
    {
        int tid = omp_get_thread_num();
        {
            #pragma omp for
            for(int64_t x0=0L; x0<ks0; x0+=1L)
            {
                for(int64_t x1=0L; x1<128L; x1+=16L)
                {
                    {
                        if(C10_LIKELY(x1 >= 0 && x1 < 128L))
                        {
                            auto tmp0 = at::vec::Vectorized<float>::loadu(
                                    in_ptr0 + (x1 + 256L*x0), 16);
                            auto tmp7 = at::vec::Vectorized<float>::loadu(
                                    in_ptr0 + (128L + x1 + 256L*x0), 16);
                            auto tmp1 = tmp0.neg();
                            auto tmp2 = tmp1.exp();
                            auto tmp3 = static_cast<float>(1.0);
                            auto tmp4 = at::vec::Vectorized<float>(tmp3);
                            auto tmp5 = tmp2 + tmp4;
                            auto tmp6 = tmp0 / tmp5;
                            auto tmp8 = tmp6 * tmp7;
                            tmp8.store(out_ptr0 + (x1 + 128L*x0));
                        }
                    }
                }
            }
        }
    }
    inductor_cpu_integer_div_error_flag = nullptr;
    inductor_cpu_throw_if_integer_div_error(inductor_cpu_integer_div_error);
}
